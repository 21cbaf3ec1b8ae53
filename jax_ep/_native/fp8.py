"""The fp8 rows of both modes' dispatches: per-token, per-128-channel e4m3 quantisation and the
UE8M0 packing of its power-of-two scales: one rounding for the reference backend, the
primitives and the public `jax_ep.quantize`. The cuda kernels compute the same; the tests hold
both to the numpy oracle's (`jax_ep.testing.oracle.fp8_quantize`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _round_up_power_of_two(s: jax.Array) -> jax.Array:
  """The smallest power of two >= s (positive float32; infinity stays), exactly, on the bits.

  NOTES: not `exp2(ceil(log2(s)))`: XLA's exp2 is not exact (2^-17 came back one ulp low)."""
  bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.uint32)
  exponent = bits & 0x7F800000
  mantissa = bits & 0x007FFFFF
  normal = jnp.where(mantissa == 0, bits, exponent + 0x00800000)
  # Subnormal: the next power of two of the mantissa.
  high = (32 - jax.lax.clz(mantissa)).astype(jnp.uint32)
  subnormal = jnp.where((mantissa & (mantissa - 1)) == 0, bits,
                        jnp.left_shift(jnp.uint32(1), high))
  return jax.lax.bitcast_convert_type(jnp.where(exponent == 0, subnormal, normal), jnp.float32)


def fp8_quantize(x: jax.Array, block: int = 128, round_scale: bool = False):
  """Per-token, per-`block`-channel e4m3 quantisation: `(q [T, H] f8, scales [T, H/block] f32)`.

  `scale = amax / 448` (1 for an all-zero block); with `round_scale` the smallest power of two
  at least that (so that a UE8M0 exponent holds it exactly). The one rounding of both modes'
  fp8 dispatches (the low-latency `row_format`, the high-throughput `wire_format`).

  Values that are not finite stay in their own elements, as the kernels leave them: a NaN is
  left out of its block's amax (the other elements keep their scale) and stays NaN; an
  infinity makes the block's scale infinite (its finite elements 0, itself NaN). `x / scale`
  saturates at +-448 (it exceeds 448 only where the scale underflowed to 0), as the kernels'
  saturating conversion does, where a plain cast would give NaN. NOTES: XLA:CPU flushes
  subnormals, the kernels keep them: a block whose amax is below 448 * 2^-126 (about 5e-36)
  has a subnormal scale on the GPU and a scale of 0 here (its values +-448, its zeros NaN)."""
  # The barrier: the amax and the division read the same stored values. XLA may otherwise
  # fuse the computation of `x` into each and round it differently in each fusion, so that a
  # scale is not the amax of what it divides, and a checkpointed recomputation quantises
  # otherwise than the forward did (seen on XLA:CPU in the FP8 experts' gradient).
  x = jax.lax.optimization_barrier(x)
  x32 = x.astype(jnp.float32)
  xb = x32.reshape(*x.shape[:-1], x.shape[-1] // block, block)
  amax = jnp.max(jnp.where(jnp.isnan(xb), 0.0, jnp.abs(xb)), axis=-1)
  scales = jnp.where(amax > 0, amax * (1.0 / 448.0), 1.0).astype(jnp.float32)
  if round_scale:
    scales = _round_up_power_of_two(scales)
  # (clip keeps a NaN: XLA's min and max propagate it.)
  q = jnp.clip(xb / scales[..., None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
  return q.reshape(x.shape), scales


def straight_through(quantise):
  """`quantise` (rows `x` -> `(q, scales)`) differentiable straight through: the rows'
  cotangent (in any float dtype) comes back as `x`'s, in `x`'s dtype; nothing of `x` is kept
  but its dtype."""
  fn = jax.custom_vjp(quantise)
  fn.defvjp(lambda x: (fn(x), jnp.zeros((0,), x.dtype)),
            lambda residual, cotangents: (cotangents[0].astype(residual.dtype),))
  return fn


def pack_ue8m0(scales: jax.Array) -> jax.Array:
  """Power-of-two float32 scales `[..., H/128]` as UE8M0 exponents (the float's biased exponent
  byte, `2^(e - 127)`), four per int32, the first in the lowest byte: `[..., H/512]`. Zero
  scales (rows nobody filled) pack as exponent 0."""
  bits = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint32)
  exponents = (bits >> 23) & 0xFF
  exponents = exponents.reshape(*scales.shape[:-1], scales.shape[-1] // 4, 4)
  packed = (exponents[..., 0] | (exponents[..., 1] << 8) | (exponents[..., 2] << 16)
            | (exponents[..., 3] << 24))
  return jax.lax.bitcast_convert_type(packed.astype(jnp.uint32), jnp.int32)


def unpack_ue8m0(packed: jax.Array) -> jax.Array:
  """`pack_ue8m0`'s inverse: int32 `[..., H/512]` -> float32 scales `[..., H/128]`, each
  `2^(e - 127)` (exponent 0 gives 0: a row nobody filled)."""
  words = jax.lax.bitcast_convert_type(packed, jnp.uint32)
  exponents = jnp.stack([(words >> (8 * i)) & 0xFF for i in range(4)], axis=-1)
  exponents = exponents.reshape(*packed.shape[:-1], packed.shape[-1] * 4)
  return jax.lax.bitcast_convert_type(exponents << 23, jnp.float32)
