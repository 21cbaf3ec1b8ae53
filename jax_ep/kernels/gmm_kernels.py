"""jax_ep's grouped GEMM kernels for Hopper GPUs (Pallas Mosaic GPU, wgmma).

Two kernels over rows grouped by expert (`x [rows, K]`, group g the `group_sizes[g]` rows after
those of groups `< g`):
- `grouped_matmul_kernel`: `y[r] = x[r] @ w[g(r)]`, `[rows, K] x [G, K, N] -> [rows, N]`.
- `grouped_weight_grad_kernel`: `dw[g] = x[rows of g]^T @ dy[rows of g]`, `-> [G, K, N]`.

Both are driven by a work list built on the device before the kernel (`row_tiles`): one item per
(row tile, group) pair that holds rows of that group, in row order. A tile that holds rows of
two groups is two items (each computes the whole tile and stores only its group's rows); a tile
inside one group is one item. The kernel's persistent loop runs over `num_items * tiles_n`
steps, a number read from device memory, so:
- no step searches the groups for its tile (the item names it), and
- no step exists for row tiles past `sum(group_sizes)`: the rows past the groups cost nothing,
  whatever the buffer's size (jax_ep's default capacity is the worst case, R times the
  balanced rows at 8 ranks).

NOTES (rows past the groups): the forward kernel stores only rows inside the groups, so the
output rows past them are unspecified, as jax_ep's contract has them; a tile that straddles the
end reads up to `block_m - 1` rows past it, but their products land only in rows it does not
store. The weight gradient sums over rows, so it selects (not multiplies: NaN * 0 is NaN) zeros
into both operands' rows outside the group before the matrix instruction.

Pallas's Mosaic GPU module is imported inside the kernel functions: it adds about half a second
to `import jax_ep`, and only Hopper runs (and the interpreter's tests) trace the kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class KernelTiles:
  """Tiles of the kernels: the output tile is `block_m x block_n`, the reduction steps
  `block_k` deep, `stages` of them in flight; `band` output column tiles are walked together
  (a band of columns of one expert's weights stays in L2 while the row tiles pass)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  band: int = 4


def num_sms() -> int:
  """Multiprocessors of the first device (the persistent grid's size); 132 where the device
  does not say (an H100 / H200 SXM has 132)."""
  try:
    return int(getattr(jax.devices()[0], "core_count", 0)) or 132
  except RuntimeError:
    return 132


def group_blocks(group_sizes, block: int):
  """Per group: its first row, its end, and its first row block and number of row blocks of
  `block` rows (`[G]` int32 each; no blocks for an empty group)."""
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first = starts // block
  count = jnp.where(sizes > 0, (ends - 1) // block - first + 1, 0)
  return starts, ends, first, count


def row_tiles(group_sizes, rows: int, block_m: int):
  """The work list: items in row order, one per (row tile, group) pair holding rows of it.

  Args:
    group_sizes: `[G]` int32, summing to at most `rows`.
    rows: the static row count. block_m: the row tile.

  Returns:
    `(tile, group, first, count, num_items)`: `[max_items]` int32 each, with
    `max_items = cdiv(rows, block_m) + G - 1` (each group boundary splits at most one tile):
    item i covers rows `tile[i] * block_m + [first[i], first[i] + count[i])` of group
    `group[i]`; items `>= num_items` (`[1]` int32) are unused (zeros).
  """
  groups = group_sizes.shape[0]
  max_items = _cdiv(rows, block_m) + groups - 1
  starts, ends, first_tile, tiles_of = group_blocks(group_sizes, block_m)
  item_end = jnp.cumsum(tiles_of)
  num_items = item_end[-1]
  i = jnp.arange(max_items, dtype=jnp.int32)
  # NOTES: a comparison against every group's end, not jnp.searchsorted: its default method is
  # a while loop, whose every step costs a launch and a host round trip on GPUs.
  group = jnp.minimum(jnp.sum(item_end[None, :] <= i[:, None], axis=1, dtype=jnp.int32),
                      groups - 1)
  tile = first_tile[group] + i - (item_end[group] - tiles_of[group])
  lo = jnp.maximum(starts[group], tile * block_m)
  hi = jnp.minimum(ends[group], (tile + 1) * block_m)
  used = i < num_items
  zero = jnp.zeros((), jnp.int32)
  return (jnp.where(used, tile, zero), jnp.where(used, group, zero),
          jnp.where(used, lo - tile * block_m, zero), jnp.where(used, hi - lo, zero),
          num_items.reshape(1).astype(jnp.int32))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _store_rows(o_smem, o_gmem, row0, first, count, col, block_m: int, block_n: int,
                max_rows: int):
  """Stores rows `[first, first + count)` of the `[block_m, block_n]` tile in shared memory to
  rows `row0 + first + ...` of `o_gmem` at column `col`. NOTES: a bulk copy's shape is static,
  so the count is written as a sum of powers of two, one copy each (at most log2(block_m) + 1;
  a whole tile is one)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  offset = first
  size = 1 << (min(block_m, max_rows).bit_length() - 1)
  while size >= 1:
    part = count & size

    @pl.when(part != 0)
    def _():
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, size)],
                              o_gmem.at[pl.ds(row0 + offset, size), pl.ds(col, block_n)])
    offset = offset + part
    size //= 2
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def grouped_matmul_kernel(x, w, group_sizes, *, transpose_w: bool, tiles: KernelTiles,
                          out_dtype=None):
  """`[rows, K] x [G, K, N] -> [rows, N]` (`w` `[G, N, K]` with `transpose_w`), fp32
  accumulation rounded to `out_dtype` (default `x.dtype`); rows past the groups unspecified.
  `K` must be a multiple of `block_k` and `N` of `block_n`."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows, k = x.shape
  n = w.shape[1] if transpose_w else w.shape[2]
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  if k % bk or n % bn:
    raise ValueError(f"grouped_matmul_kernel: K={k} must be a multiple of {bk} and N={n} of {bn}")
  out_dtype = x.dtype if out_dtype is None else out_dtype
  tiles_n = n // bn
  band = max(b for b in (tiles.band, 8, 4, 2, 1) if b <= tiles_n and tiles_n % b == 0)
  table = row_tiles(group_sizes, rows, bm)

  def body(tile_gmem, group_gmem, first_gmem, count_gmem, num_gmem, x_gmem, w_gmem, o_gmem):
    num_items = num_gmem[0]

    @plgpu.nd_loop((num_items * tiles_n,), collective_axes="sm")
    def _(info):
      item, ni = plgpu.planar_snake(info.index[0], (num_items, tiles_n), 1, band)
      tile = tile_gmem[item]
      group = group_gmem[item]

      def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            lambda _, x_smem, w_smem: plgpu.wgmma(
                acc_ref, x_smem, w_smem.transpose((1, 0)) if transpose_w else w_smem),
            grid=(k // bk,),
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (tile, kk), delay_release=1),
                plgpu.BlockSpec((bn, bk) if transpose_w else (bk, bn),
                                (lambda kk: (ni, kk)) if transpose_w else (lambda kk: (kk, ni)),
                                delay_release=1),
            ],
            max_concurrent_steps=tiles.stages,
        )(x_gmem, w_gmem.at[group])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=out_dtype))
      def _(o_smem):
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        _store_rows(o_smem, o_gmem, tile * bm, first_gmem[item], count_gmem[item], ni * bn,
                    bm, bn, rows)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((rows, n), out_dtype), grid=(num_sms(),),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(*table, x, w)


def grouped_weight_grad_kernel(x, dy, group_sizes, *, tiles: KernelTiles, out_dtype=None):
  """`dw[g] = x[rows of g]^T @ dy[rows of g]`: `[rows, K], [rows, N] -> [G, K, N]`, fp32
  accumulation rounded to `out_dtype` (default `x.dtype`); an empty group's block is zeros.
  Rows outside a group are selected away in both operands (see the module NOTES). `K` must be
  a multiple of `block_m` and `N` of `block_n`; the rows are reduced `block_k` at a time."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows, k = x.shape
  n = dy.shape[1]
  groups = group_sizes.shape[0]
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  if k % bm or n % bn:
    raise ValueError(f"grouped_weight_grad_kernel: K={k} must be a multiple of {bm} and N={n} "
                     f"of {bn}")
  out_dtype = x.dtype if out_dtype is None else out_dtype
  tiles_m, tiles_n = k // bm, n // bn
  band = max(b for b in (tiles.band, 8, 4, 2, 1) if b <= tiles_n and tiles_n % b == 0)
  itemsize = jnp.dtype(x.dtype).itemsize
  swizzle = plgpu.find_swizzle(bk * itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                plgpu.SwizzleTransform(swizzle))
  starts, ends, first_block, num_blocks = group_blocks(group_sizes, bk)

  def body(starts_gmem, ends_gmem, first_gmem, blocks_gmem, x_gmem, dy_gmem, o_gmem):

    @plgpu.nd_loop((groups, tiles_m * tiles_n), collective_axes="sm")
    def _(info):
      g = info.index[0]
      mi, ni = plgpu.planar_snake(info.index[1], (tiles_m, tiles_n), 1, band)
      start, end = starts_gmem[g], ends_gmem[g]
      first = first_gmem[g]
      blocks = blocks_gmem[g]

      def keep_rows(ref, step):
        # Rows of this block outside [start, end) become zeros in the operand itself: a select,
        # so whatever they held (NaN past the groups) cannot reach the sum.
        row = (first + step) * bk + plgpu.layout_cast(
            lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
        value = ref[...]
        ref[...] = jnp.where((row >= start) & (row < end), value, jnp.zeros_like(value))

      def acc_scope(acc_ref):
        def step_fn(idx, x_smem, dy_smem):
          step = idx[0]
          # Only a block that a group boundary cuts holds rows of another group (or past the
          # groups): the first when the group starts inside it, the last when it ends inside.
          cut_first = (step == 0) & (start % bk != 0)
          cut_last = (step == blocks - 1) & (end % bk != 0)

          @pl.when(cut_first | cut_last)
          def _():
            keep_rows(x_smem, step)
            keep_rows(dy_smem, step)
            plgpu.commit_smem()

          plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)
          if tiles.stages == 1:
            plgpu.wgmma_wait(0)

        release = 1 if tiles.stages > 1 else 0

        @pl.when(blocks > 0)
        def _():
          plgpu.emit_pipeline(
              step_fn,
              grid=(blocks,),
              in_specs=[
                  plgpu.BlockSpec((bk, bm), lambda s: (s, mi), delay_release=release,
                                  transforms=transforms),
                  plgpu.BlockSpec((bk, bn), lambda s: (s, ni), delay_release=release,
                                  transforms=transforms),
              ],
              max_concurrent_steps=tiles.stages,
          )(x_gmem.at[pl.ds(first * bk, rows)], dy_gmem.at[pl.ds(first * bk, rows)])
        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

      @functools.partial(pl.run_scoped,
                         o_smem=plgpu.SMEM((bm, bn), dtype=out_dtype, transforms=transforms))
      def _(o_smem):
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((groups, k, n), out_dtype), grid=(num_sms(),),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(starts, ends, first_block, num_blocks, x, dy)
