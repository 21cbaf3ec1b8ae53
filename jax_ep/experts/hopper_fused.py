"""A grouped GEMM for Hopper with several operands, accumulators and a fused epilogue: the
expert MLP's gated projections, the activation's derivative and the input gradient of both
projections, each in one kernel that stores only rows inside the groups.

One warpgroup per CTA, the persistent loop over the work list of `jax_ep/experts/hopper.py`
(`layout.row_tiles`: no step for row tiles past the groups); with `compute_wgs` 2 a
warp-specialized form for one pass (`_specialized`: the gated projections, the hidden
gradient), a memory warpgroup loading for two compute warpgroups of `block_n` columns each.
For each (item, column tile):
1. `passes` run in order, each an `emit_pipeline` over one row operand's reduction dimension
   that multiplies its tile by one or more weights, each into its own fp32 accumulator
   (gate and up: one pass, two weights, two accumulators; the input gradient of both
   projections: two passes into one accumulator, `dgate @ w_gate^T + dup @ w_up^T`);
2. `loads`: `[rows, N]` operands whose `block_m x block_n` tile at the output's position the
   epilogue reads (the saved gate and up projections for the activation's derivative), asked
   for before the passes and waited for after them;
3. `epilogue(accumulators, loaded)` in fp32 (the loaded tiles come in their own dtype and the
   epilogue widens them) gives the outputs, each rounded to its dtype, staged in shared memory
   and stored for the rows of the item's group only; it runs on `epilogue_columns` of the
   tile's columns at a time, so that one accumulator of 128 columns (128 registers a thread)
   leaves room for the epilogue's values.

NOTES: the rows a tile reads past the groups (or of a neighbouring group) hold anything, NaN
included; their products and epilogue values land only in rows the tile does not store, and an
epilogue is row-local, so no stored row depends on them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.experts import compile_ahead
from jax_ep.experts.configs import KernelTiles
from jax_ep.experts.hopper import (TMA_SMEM_ALIGN, _band, _store_rows, launch,
                                   work_item_loop)
from jax_ep.experts.layout import row_tiles

# A pass: (index of the row operand, ((index of a weight, index of its accumulator), ...)).
Pass = tuple[int, tuple[tuple[int, int], ...]]


def fused_grouped_kernel(xs: Sequence[jax.Array], ws: Sequence[jax.Array], group_sizes,
                         group_offsets, *, passes: Sequence[Pass], transpose_w: bool,
                         tiles: KernelTiles, epilogue: Callable, out_dtypes: Sequence,
                         loads: Sequence[jax.Array] = (), epilogue_columns: int | None = None,
                         name: str = "jax_ep_fused_gmm"):
  """The fused grouped GEMM (see the module docstring).

  Args:
    xs: row operands `[rows, K_i]`, grouped by `group_sizes` / `group_offsets`.
    ws: weights `[G, K_i, N]` (`[G, N, K_i]` with `transpose_w`), one dtype with `xs`.
    group_sizes, group_offsets: `[G]` int32.
    passes: what each accumulator sums (`Pass`).
    transpose_w: the weights are stored `[G, N, K]`.
    tiles: `block_m x block_n` output tiles, `block_k` reduction steps, `stages` in flight.
    epilogue: `(accs, loaded) -> outputs`: `[block_m, block_n]` values in (the accumulators in
      fp32, the loaded tiles in their own dtype, for the epilogue to widen), as many
      `[block_m, block_n]` values out as `out_dtypes`.
    out_dtypes: the outputs' dtypes; each output is `[rows, N]`.
    loads: `[rows, N]` operands read at each output tile's position.
    epilogue_columns: the epilogue's (and the loaded tiles') width: it runs on
      `block_n / epilogue_columns` slices of the accumulators in turn (None: the whole tile);
      the outputs are staged at least `TMA_SMEM_ALIGN` bytes wide.
    name: the kernel's name in ptxas's reports and profiles.

  Returns:
    A tuple of `[rows, N]` outputs; rows outside the groups unspecified.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows = xs[0].shape[0]
  n = ws[0].shape[1] if transpose_w else ws[0].shape[2]
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  for x in xs:
    if x.shape[1] % bk:
      raise ValueError(f"fused_grouped_kernel: K={x.shape[1]} must be a multiple of {bk}")
  if n % bn:
    raise ValueError(f"fused_grouped_kernel: N={n} must be a multiple of {bn}")
  tiles_n = n // bn
  sub_n = bn if epilogue_columns is None else epilogue_columns
  if sub_n <= 0 or bn % sub_n:
    raise ValueError(f"fused_grouped_kernel: epilogue_columns={epilogue_columns} must divide "
                     f"block_n={bn}")
  num_subs = bn // sub_n

  def stage_n(dtype):  # the staged outputs' width
    # A staged row is stored from any row by TMA: at least `TMA_SMEM_ALIGN` bytes.
    return min(bn, max(sub_n, TMA_SMEM_ALIGN // jnp.dtype(dtype).itemsize))

  num_accs = 1 + max(a for _, targets in passes for _, a in targets)
  table = row_tiles(group_sizes, rows, bm, group_offsets)
  if tiles.compute_wgs > 1:
    if len(passes) != 1:
      raise ValueError("fused_grouped_kernel: the warp-specialized kernel (compute_wgs > 1) "
                       "runs one pass")
    if n % (bn * tiles.compute_wgs):
      raise ValueError(f"fused_grouped_kernel: N={n} must be a multiple of "
                       f"{bn * tiles.compute_wgs} (block_n times compute_wgs)")
    return _specialized(table, xs[passes[0][0]], [ws[wi] for wi, _ in passes[0][1]],
                        [ai for _, ai in passes[0][1]], num_accs, tuple(loads), rows=rows,
                        n=n, sub_n=sub_n, transpose_w=transpose_w, tiles=tiles,
                        epilogue=epilogue, out_dtypes=out_dtypes, name=name,
                        settings=(tuple(passes), transpose_w, sub_n,
                                  compile_ahead.code_key(epilogue)))
  band = _band(tiles.band, tiles_n)
  num_x, num_w, num_loads = len(xs), len(ws), len(loads)

  def body(tile_gmem, group_gmem, first_gmem, count_gmem, num_gmem, *refs):
    x_refs = refs[:num_x]
    w_refs = refs[num_x:num_x + num_w]
    load_refs = refs[num_x + num_w:num_x + num_w + num_loads]
    out_refs = refs[num_x + num_w + num_loads:]

    @work_item_loop(tile_gmem, group_gmem, num_gmem, tiles_n, band)
    def _(item, ni, tile, group):
      def acc_scope(*acc_refs):
        for xi, targets in passes:
          def step(_, x_smem, *w_smems, targets=targets):
            for (_, ai), w_smem in zip(targets, w_smems):
              plgpu.wgmma(acc_refs[ai], x_smem,
                          w_smem.transpose((1, 0)) if transpose_w else w_smem)
            # NOTES: the operands stay one step longer (delay_release=1): the previous step's
            # products must have read theirs before the pipeline refills that slot, while
            # this step's stay in flight.
            plgpu.wgmma_wait(len(targets))
          w_spec = plgpu.BlockSpec(
              (bn, bk) if transpose_w else (bk, bn),
              (lambda kk: (ni, kk)) if transpose_w else (lambda kk: (kk, ni)),
              delay_release=1)
          plgpu.emit_pipeline(
              step,
              grid=(xs[xi].shape[1] // bk,),
              in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (tile, kk), delay_release=1)]
              + [w_spec] * len(targets),
              max_concurrent_steps=tiles.stages,
          )(x_refs[xi], *(w_refs[wi].at[group] for wi, _ in targets))
          plgpu.wgmma_wait(0)
        return tuple(acc[...] for acc in acc_refs)

      def tile_scope(load_smems=(), barriers=None):
        # The loaded tiles are asked for before the reduction, so that they arrive while it
        # runs (the epilogue would otherwise wait for them after it).
        for i, (ref, parts) in enumerate(zip(load_refs, load_smems)):
          for j, smem in enumerate(parts):
            plgpu.copy_gmem_to_smem(
                ref.at[pl.ds(tile * bm, bm), pl.ds(ni * bn + j * sub_n, sub_n)], smem,
                barriers.at[i * num_subs + j])
        accs = pl.run_scoped(acc_scope, *(plgpu.ACC((bm, bn)) for _ in range(num_accs)))
        for i in range(num_loads * num_subs):
          plgpu.barrier_wait(barriers.at[i])

        @functools.partial(
            pl.run_scoped,
            o_smems=[[plgpu.SMEM((bm, stage_n(dtype)), dtype)
                      for _ in range(bn // stage_n(dtype))] for dtype in out_dtypes])
        def _(o_smems):
          # The epilogue runs on `sub_n` columns at a time: its fp32 values, the loaded tiles
          # and the outputs of the whole tile beside the accumulators would not fit the
          # registers (ptxas spills).
          for j in range(num_subs):
            cols = slice(j * sub_n, (j + 1) * sub_n)
            # In their own dtype (two bf16 to a register) until the epilogue reads them.
            loaded = tuple(plgpu.layout_cast(parts[j][...], plgpu.Layout.WGMMA)
                           for parts in load_smems)
            sliced = accs if num_subs == 1 else tuple(acc[:, cols] for acc in accs)
            values = epilogue(sliced, loaded)
            for value, parts in zip(values, o_smems):
              width = parts[0].shape[1]
              o_smem = parts[j * sub_n // width]
              if width != sub_n:
                o_smem = o_smem.at[:, pl.ds(j * sub_n % width, sub_n)]
              o_smem[...] = value.astype(o_smem.dtype)
          plgpu.commit_smem()
          for parts, o_ref in zip(o_smems, out_refs):
            for j, o_smem in enumerate(parts):
              width = o_smem.shape[1]
              _store_rows(o_smem, o_ref, tile * bm, first_gmem[item], count_gmem[item],
                          ni * bn + j * width, bm, width, rows)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      if load_refs:
        # Swizzled as the weight-gradient kernel's operands, which it reads into registers.
        pl.run_scoped(
            tile_scope,
            [[plgpu.SMEM((bm, sub_n), r.dtype, transforms=_transforms(r.dtype, sub_n))
              for _ in range(num_subs)] for r in loads],
            plgpu.Barrier(num_arrivals=1, num_barriers=num_loads * num_subs))
      else:
        tile_scope()

  return launch(body, name,
                tuple(jax.ShapeDtypeStruct((rows, n), dtype) for dtype in out_dtypes), tiles,
                (*table, *xs, *ws, *loads),
                settings=(tuple(passes), transpose_w, sub_n, compile_ahead.code_key(epilogue)))


def _specialized(table, x, weights, accs_of, num_accs: int, loads, *, rows: int, n: int,
                 sub_n: int, transpose_w: bool, tiles: KernelTiles, epilogue: Callable,
                 out_dtypes, name: str, settings):
  """One pass, warp-specialized: a memory warpgroup streams `x`'s row tile and each weight's
  `block_k x (compute_wgs * block_n)` tile into a ring of `stages` slots, while each compute
  warpgroup multiplies its own `block_n` columns into its accumulators (weight `i` into
  `accs_of[i]`), runs the epilogue on them (and on its columns of the `loads`, asked for
  before the reduction) `sub_n` columns at a time, and stores its columns of each output for
  the item's rows. Per step the CTA reads `x` once for `compute_wgs` times the columns, where
  the one-warpgroup kernel reads it once for `block_n`.

  NOTES: the ring is held for the whole kernel (the memory warpgroup runs ahead into the next
  item), so the outputs are staged one at a time through one `block_m x block_n` buffer per
  warpgroup and dtype, the epilogue run again for each (its cost is small beside a tile's
  reduction; the values no output reads are dropped): each waits for the previous store's
  read of the buffer, which is short beside the reduction."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  k = x.shape[1]
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  wgs = tiles.compute_wgs
  cta_n = bn * wgs
  tiles_n = n // cta_n
  num_subs = bn // sub_n
  num_loads = len(loads)
  band = _band(tiles.band, tiles_n)
  transforms = _transforms(x.dtype, bk)
  dtypes = sorted({jnp.dtype(d) for d in out_dtypes}, key=str)
  for dtype in dtypes:
    if bn * dtype.itemsize % TMA_SMEM_ALIGN:
      raise ValueError(f"fused_grouped_kernel: a staged row of {bn} {dtype} columns is not a "
                       f"multiple of {TMA_SMEM_ALIGN} bytes")

  def body(tile_gmem, group_gmem, first_gmem, count_gmem, num_gmem, x_gmem, *refs):
    w_refs = refs[:len(weights)]
    load_refs = refs[len(weights):len(weights) + num_loads]
    out_refs = refs[len(weights) + num_loads:]

    def pipeline(tile, ni, mma_body, compute_context):
      w_spec = plgpu.BlockSpec(
          (cta_n, bk) if transpose_w else (bk, cta_n),
          (lambda kk: (ni, kk)) if transpose_w else (lambda kk: (kk, ni)),
          transforms=transforms, memory_space=plgpu.SMEM)
      return plgpu.emit_pipeline_warp_specialized(
          mma_body,
          grid=(k // bk,),
          memory_registers=40,
          in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (tile, kk), transforms=transforms,
                                    memory_space=plgpu.SMEM)] + [w_spec] * len(weights),
          wg_axis="wg",
          num_compute_wgs=wgs,
          max_concurrent_steps=tiles.stages,
          compute_context=compute_context,
      )

    ignore = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the bodies
    # Each compute warpgroup's loaded tiles, per load and epilogue slice, and their barriers.
    loaded_scope = dict(
        loaded=[[plgpu.SMEM((wgs, bm, sub_n), r.dtype, transforms=_transforms(r.dtype, sub_n))
                 for _ in range(num_subs)] for r in loads],
        barriers=plgpu.Barrier(num_arrivals=1, num_barriers=wgs * num_loads * num_subs),
    ) if loads else {}

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(0, 0, ignore, ignore).get_allocations(
            x_gmem, *(w.at[0] for w in w_refs)),
        staged=[plgpu.SMEM((wgs, bm, bn), dtype) for dtype in dtypes],
        **loaded_scope,
        collective_axes="wg")
    def _(allocations, staged, loaded=(), barriers=None):
      wg = lax.axis_index("wg")
      cols = pl.ds(wg * bn, bn)

      @work_item_loop(tile_gmem, group_gmem, num_gmem, tiles_n, band)
      def _(item, ni, tile, group):
        col0 = ni * cta_n + wg * bn  # this warpgroup's first column

        def barrier(i, j):
          return barriers.at[(wg * num_loads + i) * num_subs + j]

        def compute_context(eval_pipeline):
          # The loaded tiles are asked for before the reduction: they arrive while it runs.
          for i, (ref, parts) in enumerate(zip(load_refs, loaded)):
            for j, smem in enumerate(parts):
              plgpu.copy_gmem_to_smem(
                  ref.at[pl.ds(tile * bm, bm), pl.ds(col0 + j * sub_n, sub_n)], smem.at[wg],
                  barrier(i, j))

          @functools.partial(pl.run_scoped,
                             acc_refs=[plgpu.ACC((bm, bn), jnp.float32)
                                       for _ in range(num_accs)])
          def _(acc_refs):
            eval_pipeline(tuple(acc_refs))
            for i in range(num_loads):
              for j in range(num_subs):
                plgpu.barrier_wait(barrier(i, j))
            accs = tuple(a[...] for a in acc_refs)
            for o, (dtype, o_ref) in enumerate(zip(out_dtypes, out_refs)):
              o_smem = staged[dtypes.index(jnp.dtype(dtype))].at[wg]
              # The buffer's previous store (this item's or the previous one's) has read it.
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              for j in range(num_subs):
                loaded_j = tuple(plgpu.layout_cast(parts[j].at[wg][...], plgpu.Layout.WGMMA)
                                 for parts in loaded)
                sliced = accs if num_subs == 1 else tuple(
                    acc[:, j * sub_n:(j + 1) * sub_n] for acc in accs)
                value = epilogue(sliced, loaded_j)[o]
                target = o_smem if num_subs == 1 else o_smem.at[:, pl.ds(j * sub_n, sub_n)]
                target[...] = value.astype(dtype)
              plgpu.commit_smem()
              _store_rows(o_smem, o_ref, tile * bm, first_gmem[item], count_gmem[item], col0,
                          bm, bn, rows)

        def mma_body(_, x_smem, *w_smems_and_accs):
          *w_smems, acc_refs = w_smems_and_accs
          for ai, w_smem in zip(accs_of, w_smems):
            w_part = (w_smem.at[cols].transpose((1, 0)) if transpose_w
                      else w_smem.at[:, cols])
            plgpu.wgmma(acc_refs[ai], x_smem, w_part)
          plgpu.wgmma_wait(0)
          return acc_refs

        pipeline(tile, ni, mma_body, compute_context)(
            x_gmem, *(w.at[group] for w in w_refs), allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return launch(body, f"{name}_ws",
                tuple(jax.ShapeDtypeStruct((rows, n), dtype) for dtype in out_dtypes), tiles,
                (*table, x, *weights, *loads), threads=wgs + 1, settings=settings)


def _transforms(dtype, columns: int):
  """The tiling and swizzle of a shared-memory tile of `columns` columns of `dtype`."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(columns * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
