"""jax_ep's grouped GEMM kernel for Hopper GPUs (Pallas Mosaic GPU, wgmma), and what the Hopper
kernels share: the persistent grid, `launch`, the row-exact store of a staged tile.

`grouped_matmul_kernel`: `y[r] = x[r] @ w[g(r)]`, `[rows, K] x [G, K, N] -> [rows, N]`, over
rows grouped by expert (`x [rows, K]`, group g the `group_sizes[g]` rows after those of groups
`< g`, or from `group_offsets[g]` on: rows between groups are padding). It has a one-warpgroup
form (`emit_pipeline`) and a warp-specialized one (a memory warpgroup streams the operands
while compute warpgroups multiply and store); `KernelTiles` chooses. The weight gradient is in
`hopper_wgrad.py`.

It is driven by a work list built on the device before the kernel
(`jax_ep.experts.layout.row_tiles`): one item per
(row tile, group) pair that holds rows of that group, in row order. A tile that holds rows of
two groups is two items (each computes the whole tile and stores only its group's rows); a tile
inside one group is one item. The kernel's persistent loop runs over `num_items * tiles_n`
steps, a number read from device memory, so:
- no step searches the groups for its tile (the item names it), and
- no step exists for row tiles past `sum(group_sizes)`: the rows past the groups cost nothing,
  whatever the buffer's size (jax_ep's default capacity is the worst case, R times the
  balanced rows at 8 ranks).

NOTES (rows past the groups): the kernel stores only rows inside the groups, so the output rows
past them are unspecified, as jax_ep's contract has them; a tile that straddles the end reads
up to `block_m - 1` rows past it, but their products land only in rows it does not store.

Pallas's Mosaic GPU module is imported inside the kernel functions: it adds about half a second
to `import jax_ep`, and only Hopper runs (and the interpreter's tests) trace the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.experts import compile_ahead
from jax_ep.experts.configs import KernelTiles, current, target_devices
from jax_ep.experts.layout import row_tiles


def device_sms() -> int:
  """Multiprocessors of the device programs compile for; 132 where the device does not say
  (an H100 / H200 SXM has 132)."""
  devices = target_devices()
  return (int(getattr(devices[0], "core_count", 0)) if devices else 0) or 132


def num_sms() -> int:
  """The SMs the persistent grid is sized for: `device_sms()`, or
  `override(kernel_sms=...)`'s."""
  return current().kernel_sms or device_sms()


def persistent_grid(tiles: KernelTiles) -> tuple[int]:
  """A persistent kernel's grid: `tiles.ctas_per_sm` CTAs for each of `num_sms()`."""
  return (num_sms() * tiles.ctas_per_sm,)


# A TMA copy's shared-memory address must be 128-byte aligned (the bytes; a misaligned copy
# faults at run time).
TMA_SMEM_ALIGN = 128


def named(body, name: str):
  """`body` under `name`: Mosaic GPU names a kernel after its body function, so ptxas's reports
  and the profiler's traces show `<name>_mosaic_gpu_kernel`."""
  body.__name__ = body.__qualname__ = name
  return body


def launch(body, name: str, out_type, tiles: KernelTiles, args, *, threads: int = 1,
           settings=()):
  """`body` as jax_ep's persistent kernel `name` (Pallas Mosaic GPU, warpgroup semantics) over
  `persistent_grid(tiles)`, `threads` warpgroups a CTA (more than one: `body` takes the
  warpgroup's index, axis "wg"), applied to `args`. Compiled ahead on a pool thread the first
  time it is traced at these shapes (`compile_ahead.submit`); `settings`: what else of the
  caller decides the kernel's code (hashable), beside its name, tiles and operands."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  grid = persistent_grid(tiles)
  threaded = dict(num_threads=threads, thread_name="wg") if threads > 1 else {}
  kernel = plgpu.kernel(
      named(body, name), out_type=out_type, grid=grid, grid_names=("sm",), **threaded,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  compile_ahead.submit((name, out_type, tiles, grid, threads, settings), kernel, args)
  return kernel(*args)


def _store_rows(o_smem, o_gmem, row0, first, count, col, block_m: int, block_n: int,
                max_rows: int):
  """Stores rows `[first, first + count)` of the `[block_m, block_n]` tile in shared memory to
  rows `row0 + first + ...` of `o_gmem` at column `col`. NOTES: a bulk copy's shape is static,
  so the count is written as a sum of powers of two, one copy each (at most log2(block_m) + 1;
  a whole tile is one). The copies are left in flight: the caller waits before it reuses
  `o_smem`. A copy's shared-memory address must be `TMA_SMEM_ALIGN`-aligned, and the first
  row is any row: a row of `o_smem` is a multiple of that many bytes."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  row_bytes = o_smem.shape[-1] * jnp.dtype(o_smem.dtype).itemsize
  if row_bytes % TMA_SMEM_ALIGN:
    raise ValueError(f"_store_rows: a row of the staged tile is {row_bytes} bytes; stored from "
                     f"any row it must be a multiple of {TMA_SMEM_ALIGN} (TMA's shared-memory "
                     f"alignment)")
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


def grouped_matmul_kernel(x, w, group_sizes, group_offsets=None, *, transpose_w: bool,
                          tiles: KernelTiles, out_dtype=None):
  """`[rows, K] x [G, K, N] -> [rows, N]` (`w` `[G, N, K]` with `transpose_w`), fp32
  accumulation rounded to `out_dtype` (default `x.dtype`); rows outside the groups
  unspecified. `K` must be a multiple of `block_k` and `N` of `block_n` (of `2 * block_n` with
  two compute warpgroups)."""
  rows, k = x.shape
  n = w.shape[1] if transpose_w else w.shape[2]
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  cta_n = bn * tiles.compute_wgs
  if k % bk or n % cta_n:
    raise ValueError(f"grouped_matmul_kernel: K={k} must be a multiple of {bk} and N={n} of "
                     f"{cta_n}")
  out_dtype = x.dtype if out_dtype is None else out_dtype
  table = row_tiles(group_sizes, rows, bm, group_offsets)
  body = _forward_body_specialized if tiles.compute_wgs > 1 else _forward_body
  return body(table, x, w, transpose_w=transpose_w, tiles=tiles, out_dtype=out_dtype)


def _forward_body(table, x, w, *, transpose_w, tiles, out_dtype):
  """One warpgroup per CTA: it loads (through `emit_pipeline`), multiplies and stores."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows, k = x.shape
  n = w.shape[1] if transpose_w else w.shape[2]
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  tiles_n = n // bn
  band = _band(tiles.band, tiles_n)

  def body(tile_gmem, group_gmem, first_gmem, count_gmem, num_gmem, x_gmem, w_gmem, o_gmem):
    @work_item_loop(tile_gmem, group_gmem, num_gmem, tiles_n, band)
    def _(item, ni, tile, group):
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
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return launch(body, "jax_ep_gmm", jax.ShapeDtypeStruct((rows, n), out_dtype), tiles,
                (*table, x, w), settings=(transpose_w,))


def _forward_body_specialized(table, x, w, *, transpose_w, tiles, out_dtype):
  """Warp-specialized: per CTA a memory warpgroup streams the operands into a ring of
  `stages` shared-memory slots while `compute_wgs` warpgroups multiply, each its own
  `block_n` columns of the CTA's `block_m x (compute_wgs * block_n)` tile. A compute
  warpgroup's store of one item overlaps the loads (and the other warpgroup's products) of the
  next: only the previous store out of its own staging buffer is waited for."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows, k = x.shape
  n = w.shape[1] if transpose_w else w.shape[2]
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  wgs = tiles.compute_wgs
  cta_n = bn * wgs
  tiles_n = n // cta_n
  band = _band(tiles.band, tiles_n)
  itemsize = jnp.dtype(x.dtype).itemsize
  swizzle = plgpu.find_swizzle(bk * itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                plgpu.SwizzleTransform(swizzle))

  def body(tile_gmem, group_gmem, first_gmem, count_gmem, num_gmem, x_gmem, w_gmem, o_gmem):

    def pipeline(tile, ni, mma_body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          mma_body,
          grid=(k // bk,),
          memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((bm, bk), lambda kk: (tile, kk), transforms=transforms,
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((cta_n, bk) if transpose_w else (bk, cta_n),
                              (lambda kk: (ni, kk)) if transpose_w else (lambda kk: (kk, ni)),
                              transforms=transforms, memory_space=plgpu.SMEM),
          ],
          wg_axis="wg",
          num_compute_wgs=wgs,
          max_concurrent_steps=tiles.stages,
          compute_context=compute_context,
      )

    ignore = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(0, 0, ignore, ignore).get_allocations(x_gmem, w_gmem.at[0]),
        o_smem=plgpu.SMEM((wgs, bm, bn), out_dtype),
        collective_axes="wg")
    def _(allocations, o_smem):
      wg = lax.axis_index("wg")

      @work_item_loop(tile_gmem, group_gmem, num_gmem, tiles_n, band)
      def _(item, ni, tile, group):
        cols = pl.ds(wg * bn, bn)

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
          def _(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...].astype(out_dtype)
            # The previous item's store out of this warpgroup's buffer has read it.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[wg] = acc
            plgpu.commit_smem()
            _store_rows(o_smem.at[wg], o_gmem, tile * bm, first_gmem[item], count_gmem[item],
                        ni * cta_n + wg * bn, bm, bn, rows)

        def mma_body(_, x_smem, w_smem, acc_ref):
          w_part = (w_smem.at[cols].transpose((1, 0)) if transpose_w
                    else w_smem.at[:, cols])
          plgpu.wgmma(acc_ref, x_smem, w_part)
          plgpu.wgmma_wait(0)
          return acc_ref

        pipeline(tile, ni, mma_body, compute_context)(
            x_gmem, w_gmem.at[group], allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return launch(body, "jax_ep_gmm_ws", jax.ShapeDtypeStruct((rows, n), out_dtype), tiles,
                (*table, x, w), threads=wgs + 1, settings=(transpose_w,))


def _band(band: int, tiles_n: int) -> int:
  return max(b for b in (band, 8, 4, 2, 1) if b <= tiles_n and tiles_n % b == 0)


def work_item_loop(tile_gmem, group_gmem, num_gmem, tiles_n: int, band: int):
  """The persistent loop over the work list (`layout.row_tiles`), as a decorator: `body(item,
  ni, tile, group)` runs once for each of the `num_gmem[0] * tiles_n` (work item, column tile)
  steps, the grid's CTAs (collective axis "sm") taking them in turn and `band` column tiles of
  an item walked together (`planar_snake`); `tile` is the item's row tile and `group` its
  group, read from the work list."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def loop(body):
    num_items = num_gmem[0]

    @plgpu.nd_loop((num_items * tiles_n,), collective_axes="sm")
    def _(info):
      item, ni = plgpu.planar_snake(info.index[0], (num_items, tiles_n), 1, band)
      body(item, ni, tile_gmem[item], group_gmem[item])
  return loop
