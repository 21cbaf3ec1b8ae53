"""jax_ep's grouped GEMM kernels for Hopper GPUs (Pallas Mosaic GPU, wgmma).

Two kernels over rows grouped by expert (`x [rows, K]`, group g the `group_sizes[g]` rows after
those of groups `< g`, or from `group_offsets[g]` on: rows between groups are padding):
- `grouped_matmul_kernel`: `y[r] = x[r] @ w[g(r)]`, `[rows, K] x [G, K, N] -> [rows, N]`.
- `grouped_weight_grad_kernel`: `dw[g] = x[rows of g]^T @ dy[rows of g]`, `-> [G, K, N]`.
Each has a one-warpgroup form (`emit_pipeline`) and a warp-specialized one (a memory warpgroup
streams the operands while compute warpgroups multiply and store); `KernelTiles` and the
`specialized` flag choose. The weight gradient's one-warpgroup form can also run one pipeline
through runs of groups (`KernelTiles.groups_per_run`).

Both are driven by a work list built on the device before the kernel
(`jax_ep.experts.layout.row_tiles`): one item per
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

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.experts import compile_ahead
from jax_ep.experts.configs import KernelTiles, current, target_devices
from jax_ep.experts.layout import (aligned_blocks, cdiv, copy_aligned, group_blocks,
                                   group_bounds, group_steps, row_tiles)


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
      num_items = num_gmem[0]

      @plgpu.nd_loop((num_items * tiles_n,), collective_axes="sm")
      def _(info):
        item, ni = plgpu.planar_snake(info.index[0], (num_items, tiles_n), 1, band)
        tile = tile_gmem[item]
        group = group_gmem[item]
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


def grouped_weight_grad_kernel(x, dy, group_sizes, group_offsets=None, *, tiles: KernelTiles,
                               out_dtype=None, specialized: bool = True,
                               aligned: bool = False):
  """`dw[g] = x[rows of g]^T @ dy[rows of g]`: `[rows, K], [rows, N] -> [G, K, N]`, fp32
  accumulation rounded to `out_dtype` (default `x.dtype`); an empty group's block is zeros.
  Rows outside a group are selected away in both operands (see the module NOTES). `K` must be
  a multiple of `block_m * compute_wgs` and `N` of `block_n`; the rows are reduced `block_k`
  at a time. `compute_wgs` above 1 is a form of the warp-specialized kernel (`specialized`).

  `aligned`: both operands are first copied so that each group starts a block of `block_k`
  rows, zeros after its last row (`layout.aligned_blocks`, at least one block a group): no
  block then holds another group's rows, and none is selected."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  if aligned:
    src, count, first_block, num_blocks = aligned_blocks(group_sizes, group_offsets,
                                                         x.shape[0], bk)
    x, dy = (copy_aligned(a, src, count, bk) for a in (x, dy))
  rows, k = x.shape
  n = dy.shape[1]
  groups = group_sizes.shape[0]
  cta_m = bm * tiles.compute_wgs
  if k % cta_m or n % bn:
    raise ValueError(f"grouped_weight_grad_kernel: K={k} must be a multiple of {cta_m} and "
                     f"N={n} of {bn}")
  if tiles.compute_wgs > 1 and not specialized:
    raise ValueError(f"grouped_weight_grad_kernel: compute_wgs={tiles.compute_wgs} is a form "
                     f"of the warp-specialized kernel (specialized=True)")
  out_dtype = x.dtype if out_dtype is None else out_dtype
  tiles_m, tiles_n = k // bm, n // bn
  band = _band(tiles.band, tiles_n)
  itemsize = jnp.dtype(x.dtype).itemsize
  swizzle = plgpu.find_swizzle(bk * itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)),
                plgpu.SwizzleTransform(swizzle))
  starts, ends = group_bounds(group_sizes, group_offsets)
  if not aligned:
    first_block, num_blocks = group_blocks(starts, ends, bk)
  cuts = not aligned
  if tiles.groups_per_run > 1:
    if specialized or tiles.stages < 2:
      raise ValueError(f"grouped_weight_grad_kernel: tiles.groups_per_run > 1 is a form of the "
                       f"one-warpgroup kernel with at least 2 stages; got specialized="
                       f"{specialized}, stages={tiles.stages}")
    step_block, group_first = group_steps(first_block, num_blocks, cdiv(rows, bk) + groups)
    body = _weight_grad_body_runs(x.dtype, groups, k, n, tiles, transforms, out_dtype, cuts)
    return launch(body, "jax_ep_gmm_wgrad_runs",
                  jax.ShapeDtypeStruct((groups, k, n), out_dtype), tiles,
                  (starts, ends, step_block, group_first, x, dy), settings=(cuts,))
  if specialized:
    # An empty group's one step reads block 0, all of it selected away: a block of zeros.
    first_block = jnp.where(num_blocks > 0, first_block, 0)
    body = _weight_grad_body_specialized(rows, groups, k, n, tiles, transforms, out_dtype,
                                         cuts)
    return launch(body, "jax_ep_gmm_wgrad_ws",
                  jax.ShapeDtypeStruct((groups, k, n), out_dtype), tiles,
                  (starts, ends, first_block, num_blocks, x, dy),
                  threads=tiles.compute_wgs + 1, settings=(cuts,))

  def body(starts_gmem, ends_gmem, first_gmem, blocks_gmem, x_gmem, dy_gmem, o_gmem):

    @plgpu.nd_loop((groups, tiles_m * tiles_n), collective_axes="sm")
    def _(info):
      g = info.index[0]
      mi, ni = plgpu.planar_snake(info.index[1], (tiles_m, tiles_n), 1, band)
      start, end = starts_gmem[g], ends_gmem[g]
      first = first_gmem[g]
      blocks = blocks_gmem[g]

      def acc_scope(acc_ref):
        def step_fn(idx, x_smem, dy_smem):
          step = idx[0]
          # Only a block that a group boundary cuts holds rows of another group (or past the
          # groups): the first when the group starts inside it, the last when it ends inside.
          if cuts:
            cut_first = (step == 0) & (start % bk != 0)
            cut_last = (step == blocks - 1) & (end % bk != 0)

            @pl.when(cut_first | cut_last)
            def _():
              _keep_group_rows(x_smem, dy_smem, first + step, start, end, bk)

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

  return launch(body, "jax_ep_gmm_wgrad", jax.ShapeDtypeStruct((groups, k, n), out_dtype),
                tiles, (starts, ends, first_block, num_blocks, x, dy), settings=(cuts,))


def _weight_grad_body_runs(dtype, groups, k, n, tiles, transforms, out_dtype, cuts: bool):
  """The one-warpgroup weight gradient with one pipeline per output tile and run of
  `tiles.groups_per_run` consecutive groups: the run's groups' row blocks
  (`layout.group_steps`) stream through one ring of `stages` shared-memory slots, loaded
  `stages - 1` steps ahead across the groups' boundaries, while each group reduces into an
  accumulator of its own and stores its tile when its blocks end.

  Why: with many experts a group is a block or two of rows, so a pipeline per group and tile
  spends most of its time filling (the first loads' latency) and storing, the matrix units
  idle; in a run only its first fill is exposed, and a group's store overlaps the next group's
  loads and products (it waits only where the next tile is staged). Each group's blocks are
  reduced in the same order into zeros as by the pipeline per group: the same sums (an empty
  group has no step, and stores its accumulator's zeros).

  NOTES: the ring is written by hand, not `emit_pipeline`, because a pipeline that crosses
  groups must start each group from a zero accumulator, and a store into an accumulator
  reference is what Pallas's interpreter does not run. Every step's loads are fetched once
  (the first `stages - 1` before the run, step `i + stages - 1` by step `i`) and waited for
  once, so each slot's barrier phase stays in step across the runs."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  stages, run = tiles.stages, tiles.groups_per_run
  tiles_m, tiles_n = k // bm, n // bn
  band = _band(tiles.band, tiles_n)
  runs = cdiv(groups, run)

  def body(starts_gmem, ends_gmem, block_gmem, first_gmem, x_gmem, dy_gmem, o_gmem):

    @functools.partial(
        pl.run_scoped,
        x_ring=plgpu.SMEM((stages, bk, bm), dtype, transforms=transforms),
        dy_ring=plgpu.SMEM((stages, bk, bn), dtype, transforms=transforms),
        o_smem=plgpu.SMEM((bm, bn), out_dtype, transforms=transforms),
        barriers=plgpu.Barrier(num_arrivals=2, num_barriers=stages))
    def _(x_ring, dy_ring, o_smem, barriers):

      @plgpu.nd_loop((runs, tiles_m * tiles_n), collective_axes="sm")
      def _(info):
        g0 = info.index[0] * run
        g1 = jnp.minimum(g0 + run, groups)
        begin, end = first_gmem[g0], first_gmem[g1]
        mi, ni = plgpu.planar_snake(info.index[1], (tiles_m, tiles_n), 1, band)

        def fetch(i):
          slot = lax.rem(i - begin, stages)
          rows = pl.ds(block_gmem[i] * bk, bk)
          plgpu.copy_gmem_to_smem(x_gmem.at[rows, pl.ds(mi * bm, bm)], x_ring.at[slot],
                                  barriers.at[slot])
          plgpu.copy_gmem_to_smem(dy_gmem.at[rows, pl.ds(ni * bn, bn)], dy_ring.at[slot],
                                  barriers.at[slot])

        for ahead in range(stages - 1):
          pl.when(begin + ahead < end)(lambda ahead=ahead: fetch(begin + ahead))

        @pl.loop(g0, g1)
        def _(g):
          lo, hi = starts_gmem[g], ends_gmem[g]

          def reduce(acc_ref):
            @pl.loop(first_gmem[g], first_gmem[g + 1])
            def _(i):
              slot = lax.rem(i - begin, stages)
              plgpu.barrier_wait(barriers.at[slot])
              x_smem, dy_smem = x_ring.at[slot], dy_ring.at[slot]
              if cuts:
                block = block_gmem[i]

                # Only a block that a group boundary cuts holds rows outside the group.
                @pl.when((block * bk < lo) | ((block + 1) * bk > hi))
                def _():
                  _keep_group_rows(x_smem, dy_smem, block, lo, hi, bk)

              plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)
              # The previous step's product has read its slot: refill that slot.
              plgpu.wgmma_wait(1)
              pl.when(i + stages - 1 < end)(lambda: fetch(i + stages - 1))
            return acc_ref[...]

          acc = pl.run_scoped(reduce, plgpu.ACC((bm, bn))).astype(out_dtype)
          # The last tile's store has read the staging buffer.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          o_smem[...] = acc
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[g, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return body


def reduction_allocations(pipeline, *gmems):
  """The shared memory of a weight gradient's warp-specialized pipeline, `pipeline(first,
  steps, mi, ni, mma_body, compute_context)`, over `gmems`, for a `pl.run_scoped` around the
  kernel's loop: what it allocates depends on none of those arguments."""
  ignore = lambda *_, **__: None  # noqa: E731
  zero = jnp.int32(0)
  return pipeline(zero, zero + 1, zero, zero, ignore, ignore).get_allocations(*gmems)


def _keep_group_rows(x_smem, dy_smem, block, start, end, block_k: int):
  """`_keep_rows` of both operands' slots of a block a group boundary cuts, committed for the
  matrix instruction (the async proxy) that reads them next."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  _keep_rows(x_smem, block, start, end, block_k)
  _keep_rows(dy_smem, block, start, end, block_k)
  plgpu.commit_smem()


def _keep_rows(ref, block, start, end, block_k: int):
  """Rows of the `block_k`-row block `block` of an operand outside `[start, end)` become zeros
  in shared memory: a select, so whatever they held (NaN outside the groups) cannot reach the
  sum."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  row = block * block_k + plgpu.layout_cast(
      lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
  value = ref[...]
  ref[...] = jnp.where((row >= start) & (row < end), value, jnp.zeros_like(value))


def _weight_grad_body_specialized(rows, groups, k, n, tiles, transforms, out_dtype,
                                  cuts: bool = True):
  """The weight gradient warp-specialized: a memory warpgroup streams the group's row blocks
  (and, while the compute warpgroups store one output tile, the next tile's first blocks);
  `compute_wgs` compute warpgroups each reduce `block_m` rows of the CTA's `(compute_wgs *
  block_m) x block_n` output tile, sharing the `dy` block (two: each step's products read 48
  KiB for 4 MFLOP where one warpgroup's read 32 for 2, so the shared memory fill from L2
  bounds them less). Each compute warpgroup selects away the rows outside the group in a cut
  block's slot, its part of `x` and the whole `dy`, before it multiplies: the selects of two
  warpgroups in `dy` write the same values (zeros, or what the row held), so neither needs
  the other's barrier, and each multiplies only after its own."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  wgs = tiles.compute_wgs
  cta_m = bm * wgs
  tiles_m, tiles_n = k // cta_m, n // bn
  band = _band(tiles.band, tiles_n)
  del rows

  def body(starts_gmem, ends_gmem, first_gmem, blocks_gmem, x_gmem, dy_gmem, o_gmem):

    def pipeline(first, steps, mi, ni, mma_body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          mma_body,
          grid=(steps,),
          memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((bk, cta_m), lambda s: (first + s, mi), transforms=transforms,
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((bk, bn), lambda s: (first + s, ni), transforms=transforms,
                              memory_space=plgpu.SMEM),
          ],
          wg_axis="wg",
          num_compute_wgs=wgs,
          max_concurrent_steps=tiles.stages,
          compute_context=compute_context,
      )

    @functools.partial(
        pl.run_scoped,
        allocations=reduction_allocations(pipeline, x_gmem, dy_gmem),
        o_smem=plgpu.SMEM((wgs, bm, bn), out_dtype, transforms=transforms),
        collective_axes="wg")
    def _(allocations, o_smem):
      wg = lax.axis_index("wg") if wgs > 1 else 0

      @plgpu.nd_loop((groups, tiles_m * tiles_n), collective_axes="sm")
      def _(info):
        g = info.index[0]
        mi, ni = plgpu.planar_snake(info.index[1], (tiles_m, tiles_n), 1, band)
        start, end = starts_gmem[g], ends_gmem[g]
        first = first_gmem[g]
        blocks = blocks_gmem[g]

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
          def _(acc_ref):
            eval_pipeline(acc_ref)
            acc = acc_ref[...].astype(out_dtype)
            # The previous tile's store has read this warpgroup's staging buffer.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[wg] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[wg],
                o_gmem.at[g, pl.ds(mi * cta_m + wg * bm, bm), pl.ds(ni * bn, bn)])

        def mma_body(idx, x_smem, dy_smem, acc_ref):
          step = idx[0]
          x_part = x_smem if wgs == 1 else x_smem.at[:, pl.ds(wg * bm, bm)]
          # Only a block that a group boundary cuts holds rows of another group (or outside the
          # groups): the first when the group starts inside it, the last when it ends inside;
          # an empty group's one block is all outside.
          if cuts:
            cut = (((step == 0) & (start % bk != 0)) | ((step == blocks - 1) & (end % bk != 0))
                   | (blocks == 0))

            @pl.when(cut)
            def _():
              _keep_group_rows(x_part, dy_smem, first + step, start, end, bk)

          plgpu.wgmma(acc_ref, x_part.transpose((1, 0)), dy_smem)
          plgpu.wgmma_wait(0)
          return acc_ref

        pipeline(first, jnp.maximum(blocks, 1), mi, ni, mma_body, compute_context)(
            x_gmem, dy_gmem, allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return body
