"""jax_ep's FP8 weight gradient for Hopper GPUs (Pallas Mosaic GPU, e4m3 wgmma), DeepSeek-V3's
128 x 1 blocks: `dw[g] = a[g]^T b[g]` per expert, reduced over the group's tokens, both
operands quantised per 128 tokens per channel.

The reduction is over the tokens, and FP8 wgmma takes both operands K-major, so the operands
are the tokens' transposes (`quantize_kernel.quantize_column_blocks`: `[channels, tokens]`
e4m3, one scale per channel per 128 tokens) in a copy that starts each group at a 128-token
block (`layout.aligned_blocks`): every block is one group's, so the product reads no other
group's tokens and needs no mask. The work list is (group, row tile, column tile); each item's
pipeline runs over the group's blocks (a count read from memory); each block's product is
promoted into the fp32 totals (why every 128: `hopper_fp8.py`) times the outer product of both
operands' scales (each varies along one side of the output). Warp-specialized only: a memory
warpgroup streams both operands' tiles and scales, `compute_wgs` warpgroups split the tile's
rows (registers and shared memory as in `hopper_fp8.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.experts.configs import KernelTiles
from jax_ep.experts.hopper import _band, launch
from jax_ep.experts.hopper_wgrad import reduction_allocations
from jax_ep.experts.hopper_fp8 import SCALE_BLOCK, _check_tiles


def fp8_weight_grad_kernel(a, a_scales, b, b_scales, group_first, group_blocks, *,
                           tiles: KernelTiles, out_dtype=jnp.bfloat16, parts: int = 1):
  """The block-scaled FP8 weight gradient, one `[P, Q]` product per group reduced over the
  group's tokens: `out[g, p, q] = sum_j (a[p, J] . b[q, J]) * a_scales[j, p] * b_scales[j,
  q]` over the group's blocks `j` (`J` its 128 tokens), each block's product promoted into the
  fp32 totals, rounded once to `out_dtype`.

  Args:
    a: `[P, NB * 128]` float8_e4m3fn, the tokens along the rows of each channel: the
      group-aligned copy of `quantize_kernel.quantize_column_blocks`.
    a_scales: `[NB, P]` float32, one per 128 tokens per channel.
    b, b_scales: `[Q, NB * 128]` e4m3 and `[NB, Q]` f32, the same for the other operand.
    group_first, group_blocks: `[G]` int32, each group's first block and number of blocks
      (`layout.aligned_blocks`: at least one each, an empty group's all zeros).
    tiles: `block_k` 128 (the tokens' scale block), `block_m` rows of P per tile (64 per
      compute warpgroup), `block_n` columns of Q.
    out_dtype: the result's dtype.
    parts: the result split along Q into this many arrays (the gate's and the up
      projection's gradients of one `b` holding both cotangents side by side).

  Returns:
    A tuple of `parts` arrays `[G, P, Q / parts]` `out_dtype`.

  NOTES: the scales of both operands vary along the output (a row's, a column's), so the
  promotion multiplies each block's product by their outer product; a block is one group's
  (the copy starts each group at a block), so the product reads no other group's tokens and
  needs no mask.
  """
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  name = "fp8_weight_grad_kernel"
  for label, x in (("a", a), ("b", b)):
    if x.ndim != 2 or x.dtype != jnp.float8_e4m3fn:
      raise ValueError(f"{name}: {label} must be [channels, tokens] float8_e4m3fn, got "
                       f"{x.dtype} {x.shape}")
  (p, tokens), q = a.shape, b.shape[0]
  num_blocks = tokens // SCALE_BLOCK
  if b.shape[1] != tokens or tokens % SCALE_BLOCK:
    raise ValueError(f"{name}: a {a.shape} and b {b.shape} must share the tokens, a multiple "
                     f"of {SCALE_BLOCK}")
  for label, s, channels in (("a_scales", a_scales, p), ("b_scales", b_scales, q)):
    if s.shape != (num_blocks, channels) or s.dtype != jnp.float32:
      raise ValueError(f"{name}: {label} must be float32 {(num_blocks, channels)}, got "
                       f"{s.dtype} {s.shape}")
  groups = group_first.shape[0]
  if group_blocks.shape != (groups,):
    raise ValueError(f"{name}: group_first {group_first.shape} and group_blocks "
                     f"{group_blocks.shape} must be [G]")
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  wgs = tiles.compute_wgs
  part_m = bm // wgs
  if p % bm or q % (bn * parts):
    raise ValueError(f"{name}: tiles {tiles} must divide P={p} (block_m) and Q={q} / {parts} "
                     f"(block_n)")
  buffers = ((bn, out_dtype),)
  smem = tiles.stages * (bm * bk + bn * bk + (bm + bn) * 4) + bm * bn * jnp.dtype(
      out_dtype).itemsize
  _check_tiles(name, tiles, 1, smem, buffers)
  tiles_p, tiles_q = p // bm, q // bn
  part_tiles = tiles_q // parts
  band = _band(tiles.band, tiles_q)
  transforms = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))

  def body(first_gmem, blocks_gmem, a_gmem, as_gmem, b_gmem, bs_gmem, *o_gmems):

    def pipeline(first, steps, mi, ni, mma_body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          mma_body,
          grid=(steps,),
          memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((bm, bk), lambda s: (mi, first + s), transforms=transforms,
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((1, bm), lambda s: (first + s, mi), memory_space=plgpu.SMEM),
              plgpu.BlockSpec((bn, bk), lambda s: (ni, first + s), transforms=transforms,
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((1, bn), lambda s: (first + s, ni), memory_space=plgpu.SMEM),
          ],
          wg_axis="wg",
          num_compute_wgs=wgs,
          max_concurrent_steps=tiles.stages,
          compute_context=compute_context,
      )

    @functools.partial(
        pl.run_scoped,
        allocations=reduction_allocations(pipeline, a_gmem, as_gmem, b_gmem, bs_gmem),
        o_smem=plgpu.SMEM((wgs, part_m, bn), out_dtype),
        collective_axes="wg")
    def _(allocations, o_smem):
      wg = lax.axis_index("wg")
      own_rows = pl.ds(wg * part_m, part_m)

      @plgpu.nd_loop((groups * tiles_p * tiles_q,), collective_axes="sm")
      def _(info):
        g = info.index[0] // (tiles_p * tiles_q)
        mi, ni = plgpu.planar_snake(info.index[0] % (tiles_p * tiles_q), (tiles_p, tiles_q),
                                    1, band)
        first, steps = first_gmem[g], blocks_gmem[g]

        def compute_context(eval_pipeline):
          (totals,) = eval_pipeline((jnp.zeros((part_m, bn), jnp.float32),))
          # The previous tile's store out of this warpgroup's buffer has read it.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          staged = o_smem.at[wg]
          staged[...] = totals.astype(out_dtype)
          plgpu.commit_smem()
          rows = pl.ds(mi * bm + wg * part_m, part_m)
          columns = pl.ds((ni % part_tiles) * bn, bn)
          for i, o_gmem in enumerate(o_gmems):
            @pl.when(ni // part_tiles == i)
            def _(o_gmem=o_gmem):
              plgpu.copy_smem_to_gmem(staged, o_gmem.at[g, rows, columns])

        def mma_body(idx, a_smem, as_smem, b_smem, bs_smem, carry):
          del idx
          (total,) = carry
          # The scales are read before the product is issued, and the read committed before
          # the memory warpgroup may refill the slot (TMA, the async proxy).
          a_s = as_smem[0, own_rows]
          b_s = bs_smem[0]
          plgpu.commit_smem()

          def product(part_ref):
            plgpu.wgmma(part_ref, a_smem.at[own_rows], b_smem.transpose((1, 0)))
            return part_ref[...]
          part = pl.run_scoped(product, plgpu.ACC((part_m, bn)))
          return (total + part * a_s[:, None] * b_s[None, :],)

        pipeline(first, steps, mi, ni, mma_body, compute_context)(
            a_gmem, as_gmem, b_gmem, bs_gmem, allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return tuple(launch(body, "jax_ep_fp8_wgrad_ws",
                      (jax.ShapeDtypeStruct((groups, p, q // parts), out_dtype),) * parts,
                      tiles, (group_first, group_blocks, a, a_scales, b, b_scales),
                      threads=wgs + 1))
