"""The expert weights' FP8 quantisation in one pass (Pallas Triton, GPUs): each 128 x 128 block
of a `[G, K, N]` master read once, its amax, scale and e4m3 rounding in registers, the values
written transposed (`[G, N, K]`, K contiguous: what the FP8 products read).

XLA computes the same in two passes over the master (the blocks' amax, then the rounding that
reads the master again): 2 bytes an element read twice where this reads them once. The rule is
`fp8._quantize_blocks`'s, bit for bit: `scale = amax * (1 / 448)` (1 for an all-zero block),
`q = w * (1 / scale)` rounded to nearest even. NOTES (the reciprocal): XLA computes `w /
scale` as `w * (1 / scale)` (it turns a division by a broadcast into a multiplication by the
reciprocal), which rounds otherwise than the quotient where that sits at an e4m3 rounding
boundary (81 of the 294,912 values of the tests' bf16 weights): the rule is what XLA computes,
on every backend. The reciprocal is PTX's `rcp.rn.f32` (IEEE, as XLA's `1 / scale`); Triton's
own f32 division is `div.full.f32`, within 2 ulp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ep._native.varying import vary_like_operands

BLOCK = 128
_E4M3_MAX = 448.0
# One 128 x 128 block per program: 32 KiB of bf16 in, 16 KiB of e4m3 out through the
# transposing layout conversion; eight warps hold it at 64 fp32 values a thread (four would
# hold 128, half of a thread's registers, beside the conversion's).
_NUM_WARPS = 8


def _reciprocal(x, interpret: bool):
  """`1 / x` in fp32, rounded to nearest (IEEE)."""
  if interpret:
    return 1.0 / x
  from jax.experimental.pallas import triton as plgpu
  [r] = plgpu.elementwise_inline_asm(
      "rcp.rn.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return r


def _block_kernel(w_ref, values_ref, scales_ref, *, interpret: bool):
  """One `[K, N]` block of one expert: its scale and its e4m3 values, transposed."""
  w = w_ref[...].astype(jnp.float32)
  amax = jnp.max(jnp.abs(w))
  scale = jnp.full((1, 1), jnp.where(amax > 0, amax * (1.0 / _E4M3_MAX), 1.0), jnp.float32)
  # One reciprocal per block, on a [1, 1] tile (a whole block's would double the registers).
  reciprocal = _reciprocal(scale, interpret)
  q = (w * reciprocal).astype(jnp.float8_e4m3fn)
  values_ref[...] = q.T
  scales_ref[...] = scale


def quantize_weight_blocks(w, *, interpret: bool = False):
  """`(values [G, N, K] e4m3, scales [G, N / 128, K / 128] f32)` of `w` `[G, K, N]` (K and N
  multiples of 128, checked by the caller). `interpret`: in Pallas's interpreter (the CPU)."""
  if interpret:
    # Pallas's own interpreter, not the Mosaic GPU one to which `force_gpu_interpret_mode` (the
    # Mosaic kernels' tests) sends every pallas_call: that one takes no blocked BlockSpecs.
    from jax.experimental.pallas import mosaic_gpu
    with mosaic_gpu.force_gpu_interpret_mode(None):
      return _blocks(w, interpret=True)
  return _blocks(w, interpret=False)


def _blocks(w, *, interpret: bool):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  groups, k, n = w.shape
  # NOTES: inside shard_map a pallas_call's result must be given its varying axes: the weight's.
  (w,) = vary_like_operands((w,), (w,))
  manual = getattr(jax.typeof(w), "manual_axis_type", None)
  return pl.pallas_call(
      functools.partial(_block_kernel, interpret=interpret),
      grid=(groups, k // BLOCK, n // BLOCK),
      in_specs=[pl.BlockSpec((None, BLOCK, BLOCK), lambda g, i, j: (g, i, j))],
      out_specs=[pl.BlockSpec((None, BLOCK, BLOCK), lambda g, i, j: (g, j, i)),
                 pl.BlockSpec((None, 1, 1), lambda g, i, j: (g, j, i))],
      out_shape=[jax.ShapeDtypeStruct((groups, n, k), jnp.float8_e4m3fn,
                                      manual_axis_type=manual),
                 jax.ShapeDtypeStruct((groups, n // BLOCK, k // BLOCK), jnp.float32,
                                      manual_axis_type=manual)],
      compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
      interpret=interpret, name="jax_ep_quantize_weights",
  )(w)
