"""jax_ep's grouped weight-gradient kernel for Hopper GPUs (Pallas Mosaic GPU, wgmma):
`dw[g] = x[rows of g]^T @ dy[rows of g]`, `[rows, K], [rows, N] -> [G, K, N]`, over rows grouped
by expert as `hopper.grouped_matmul_kernel`'s (rows between and past the groups are padding).

A one-warpgroup form (`emit_pipeline` per group and output tile, or one pipeline through runs of
groups: `KernelTiles.groups_per_run`) and a warp-specialized one (a memory warpgroup streams the
row blocks while `compute_wgs` compute warpgroups multiply and store); `KernelTiles` and the
`specialized` flag choose.

NOTES (rows outside the groups): the kernel sums over rows, so it selects (not multiplies: NaN *
0 is NaN) zeros into both operands' rows outside the group before the matrix instruction, in the
blocks a group boundary cuts; or, with `aligned`, it reads group-aligned copies in which no block
holds another group's rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.experts.configs import KernelTiles
from jax_ep.experts.hopper import _band, launch
from jax_ep.experts.layout import (aligned_blocks, cdiv, copy_aligned, group_blocks,
                                   group_bounds, group_steps)


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
