"""The FP8 recipe's quantisations in one pass each (Pallas Triton, GPUs).

`quantize_weight_blocks`: the expert weights, each 128 x 128 block of a `[G, K, N]` master read
once, its amax, scale and e4m3 rounding in registers, the values written transposed (`[G, N,
K]`, K contiguous: what the FP8 products read). `activation_grad_blocks`: the FP8 MLP's activation
gradient between its backward products; `quantize_row_blocks`: rows per 128 channels;
`quantize_column_blocks`: the weight gradients' operands per 128 tokens per channel,
transposed (below).

XLA computes the same in two passes over the master (the blocks' amax, then the rounding that
reads the master again): 2 bytes an element read twice where this reads them once. The rule is
`fp8._quantize_blocks`'s, bit for bit: `scale = amax * (1 / 448)` (1 for an all-zero block),
`q = w * (1 / scale)` rounded to nearest even. NOTES (the reciprocal): XLA computes `w /
scale` as `w * (1 / scale)` (it turns a division by a broadcast into a multiplication by the
reciprocal), which rounds otherwise than the quotient where that sits at an e4m3 rounding
boundary (81 of the 294,912 values of the tests' bf16 weights): the rule is what XLA computes,
on every backend. The reciprocal is PTX's `rcp.rn.f32` (IEEE, as XLA's `1 / scale`); Triton's
own f32 division is `div.full.f32`, within 2 ulp. A NaN is left out of its block's amax (the
rows' rule, `jax_ep._native.fp8.fp8_quantize`): the block's other values keep their scale, the
NaN stays in its element.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

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
  amax = jnp.max(jnp.where(jnp.isnan(w), 0.0, jnp.abs(w)))
  scale = jnp.full((1, 1), jnp.where(amax > 0, amax * (1.0 / _E4M3_MAX), 1.0), jnp.float32)
  # One reciprocal per block, on a [1, 1] tile (a whole block's would double the registers).
  reciprocal = _reciprocal(scale, interpret)
  q = (w * reciprocal).astype(jnp.float8_e4m3fn)
  values_ref[...] = q.T
  scales_ref[...] = scale


def quantize_weight_blocks(w, *, interpret: bool = False):
  """`(values [G, N, K] e4m3, scales [G, N / 128, K / 128] f32)` of `w` `[G, K, N]` (K and N
  multiples of 128, checked by the caller). `interpret`: in Pallas's interpreter (the CPU)."""
  return _run(_blocks, w, interpret=interpret)


def _run(kernel, *args, interpret: bool):
  """`kernel(*args, interpret=interpret)`: interpreted, in Pallas's own interpreter, not the
  Mosaic GPU one to which `force_gpu_interpret_mode` (the Mosaic kernels' tests) sends every
  pallas_call: that one takes no blocked BlockSpecs."""
  if not interpret:
    return kernel(*args, interpret=False)
  from jax.experimental.pallas import mosaic_gpu
  with mosaic_gpu.force_gpu_interpret_mode(None):
    return kernel(*args, interpret=True)


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


# ------------------------------------------------------------------------------------------
# The FP8 MLP's rows, per 128 channels: the activation gradient between its two backward
# products, and the rows it quantises itself, each in one pass.

# Rows a program takes (one 128-column block each); the largest that divides the rows.
_ROW_BLOCKS = (64, 32, 16, 8)
_ROW_WARPS = 4


def rows_per_program(rows: int) -> int | None:
  """The rows each program of `activation_grad_blocks` and `quantize_row_blocks` takes at
  `rows`, None where none divides it."""
  return next((r for r in _ROW_BLOCKS if rows % r == 0), None)


def _quantize_row_block(d, interpret: bool):
  """`fp8_quantize`'s rule on a `[rows, 128]` float32 block: `(e4m3 values, [rows, 1] scales)`.
  A NaN is left out of its row's amax, `scale = amax / 448` (1 for an all-zero row), values
  `d * (1 / scale)` saturated at +-448, a NaN kept NaN."""
  amax = jnp.max(jnp.where(jnp.isnan(d), 0.0, jnp.abs(d)), axis=1)[:, None]
  scale = jnp.where(amax > 0, amax * (1.0 / _E4M3_MAX), 1.0)
  q = d * _reciprocal(scale, interpret)
  # NOTES: Pallas lowers min / max to Triton as minnumf / maxnumf, which return the other
  # operand for a NaN: the clip alone would turn a NaN into +-448, a finite value, silently.
  q = jnp.where(jnp.isnan(q), q, jnp.clip(q, -_E4M3_MAX, _E4M3_MAX))
  return q.astype(jnp.float8_e4m3fn), scale


def _activation_grad_kernel(*refs, activation: str, gated: bool, interpret: bool):
  """One `[rows, 128]` block of every projection's cotangent: its bf16 copy, and its e4m3
  values and per-row scales, each at the projection's place in `[dgate | dup]`."""
  from jax_ep.experts.mlp import act, act_grad
  if gated:
    dh_ref, gate_ref, up_ref, q_ref, scales_ref, copy_ref = refs
  else:
    dh_ref, gate_ref, q_ref, scales_ref, copy_ref = refs
  dh = dh_ref[...].astype(jnp.float32)
  g = gate_ref[...].astype(jnp.float32)
  if gated:
    # The expressions of mlp_fp8's XLA path, in its order.
    parts = (dh * up_ref[...].astype(jnp.float32) * act_grad(g, activation),
             dh * act(g, activation))
  else:
    parts = (dh * act_grad(g, activation),)
  for p, d in enumerate(parts):
    copy_ref[:, p, :] = d.astype(copy_ref.dtype)
    q_ref[:, p, :], scales_ref[:, p, :] = _quantize_row_block(d, interpret)


def activation_grad_blocks(dh, gate, up, activation: str, *, interpret: bool = False):
  """The cotangents of the MLP's projections from `dh` `[R, F]` (float32, the hidden
  gradient's product) and the saved `gate` and `up` (`[R, F]` bf16; `up` None for the plain
  activations): `(q [R, P * F] e4m3, scales [R, P * F / 128] f32, copies [R, P * F] bf16)`,
  P = 2 gated (else 1): `fp8_quantize` of each cotangent side by side, as `[dgate | dup]`, and
  their bf16 copies side by side the same way (the weight gradients' rows). R must be a
  multiple of 8 (`rows_per_program`) and F of 128, checked by the caller.

  NOTES: one read of `dh`, `gate` and `up` and one write of each result, where XLA wrote both
  cotangents in float32 and bf16 and read the float32 twice more (the blocks' amax, then the
  rounding and the concatenation)."""
  return _run(functools.partial(_activation_grad, activation=activation), dh, gate, up,
              interpret=interpret)


def _activation_grad(dh, gate, up, *, activation: str, interpret: bool):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  rows, ffn = dh.shape
  gated = up is not None
  parts = 2 if gated else 1
  block_rows = rows_per_program(rows)
  operands = (dh, gate, up) if gated else (dh, gate)
  operands = vary_like_operands(operands, operands)
  manual = getattr(jax.typeof(dh), "manual_axis_type", None)
  tile = pl.BlockSpec((block_rows, BLOCK), lambda i, j: (i, j))
  shape = lambda s, dtype: jax.ShapeDtypeStruct(s, dtype, manual_axis_type=manual)  # noqa: E731
  q, scales, copies = pl.pallas_call(
      functools.partial(_activation_grad_kernel, activation=activation, gated=gated,
                        interpret=interpret),
      grid=(rows // block_rows, ffn // BLOCK),
      in_specs=[tile] * len(operands),
      out_specs=[pl.BlockSpec((block_rows, parts, BLOCK), lambda i, j: (i, 0, j)),
                 pl.BlockSpec((block_rows, parts, 1), lambda i, j: (i, 0, j)),
                 pl.BlockSpec((block_rows, parts, BLOCK), lambda i, j: (i, 0, j))],
      out_shape=[shape((rows, parts, ffn), jnp.float8_e4m3fn),
                 shape((rows, parts, ffn // BLOCK), jnp.float32),
                 shape((rows, parts, ffn), jnp.bfloat16)],
      compiler_params=plgpu.CompilerParams(num_warps=_ROW_WARPS, num_stages=1),
      interpret=interpret, name="jax_ep_fp8_activation_grad",
  )(*operands)
  return (q.reshape(rows, parts * ffn), scales.reshape(rows, parts * ffn // BLOCK),
          copies.reshape(rows, parts * ffn))


def _row_blocks_kernel(x_ref, q_ref, scales_ref, *, interpret: bool):
  q_ref[...], scales_ref[...] = _quantize_row_block(x_ref[...].astype(jnp.float32), interpret)


def quantize_row_blocks(x, *, interpret: bool = False):
  """`fp8_quantize(x)` of `x` `[R, H]` (bf16 or float32; R a multiple of 8,
  `rows_per_program`, and H of 128, checked by the caller) in one pass: `(q [R, H] e4m3,
  scales [R, H / 128] f32)`, the same rule. NOTES: XLA reads `x` twice (the blocks' amax,
  then the rounding)."""
  return _run(_row_blocks, x, interpret=interpret)


def _row_blocks(x, *, interpret: bool):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  rows, hidden = x.shape
  block_rows = rows_per_program(rows)
  (x,) = vary_like_operands((x,), (x,))
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return pl.pallas_call(
      functools.partial(_row_blocks_kernel, interpret=interpret),
      grid=(rows // block_rows, hidden // BLOCK),
      in_specs=[pl.BlockSpec((block_rows, BLOCK), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((block_rows, BLOCK), lambda i, j: (i, j)),
                 pl.BlockSpec((block_rows, 1), lambda i, j: (i, j))],
      out_shape=[jax.ShapeDtypeStruct((rows, hidden), jnp.float8_e4m3fn,
                                      manual_axis_type=manual),
                 jax.ShapeDtypeStruct((rows, hidden // BLOCK), jnp.float32,
                                      manual_axis_type=manual)],
      compiler_params=plgpu.CompilerParams(num_warps=_ROW_WARPS, num_stages=1),
      interpret=interpret, name="jax_ep_fp8_quantize_rows",
  )(x)


# ------------------------------------------------------------------------------------------
# The FP8 weight gradient's operands: per 128 rows (tokens) per channel, transposed.

def _column_blocks_kernel(src_ref, count_ref, x_ref, *refs, last: int, from_e4m3: bool,
                          interpret: bool):
  """One block of the copy (up to 128 rows of one group, from row `src`) and 128 channels:
  each channel's scale over the block's rows, its e4m3 values transposed. Rows past `count`
  are zeros; a block without rows is not written, but the last (the empty groups' block),
  written as zeros."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  if from_e4m3:
    xs_ref, q_ref, scales_ref = refs
  else:
    q_ref, scales_ref = refs
  b, c = pl.program_id(0), pl.program_id(1)
  src, count = src_ref[b], count_ref[b]

  @pl.when((count > 0) | (b == last))
  def _():
    rows = pl.ds(src, BLOCK)
    inside = lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0) < count
    row_inside = lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0) < count
    # Masked loads (the block's rows may run past the array), their other rows selected away
    # after the cast (Triton takes no e4m3 `other`).
    x = plgpu.load(x_ref.at[rows, pl.ds(c * BLOCK, BLOCK)], mask=inside)
    x = x.astype(jnp.float32)
    if from_e4m3:
      x = x * plgpu.load(xs_ref.at[rows, pl.ds(c, 1)], mask=row_inside)
    x = jnp.where(inside, x, 0.0)
    q, scale = _quantize_row_block(x.T, interpret)
    q_ref[...] = q
    scales_ref[...] = scale.T


def quantize_column_blocks(x, x_scales, src, count, *, interpret: bool = False):
  """`x` `[R, C]` quantised per 128 rows per channel into the group-aligned copy of
  `layout.aligned_blocks` (`src`, `count` `[NB]`), transposed: `(q [C, NB * 128] e4m3, scales
  [NB, C] f32)`, `x[src[b] + i, c] ~= q[c, 128 b + i] * scales[b, c]` for `i < count[b]`, the
  copy's other rows of a block zeros. `fp8_quantize`'s rule along the tokens (a NaN kept, left
  out of the scale). `x` bf16 or float32, or e4m3 with its `[R, C / 128]` row scales
  (`x_scales`; None otherwise): dequantised in registers first. C a multiple of 128, checked by
  the caller.

  NOTES: what the FP8 weight gradient reduces over is the tokens, and FP8 wgmma takes both
  operands with the reduction contiguous (K-major): the copy is the tokens' transpose, one row
  per channel. Each group starting at a block makes every block one group's, so the product
  needs no mask and each block's scale is its own group's."""
  return _run(_column_blocks, x, x_scales, src, count, interpret=interpret)


def _column_blocks(x, x_scales, src, count, *, interpret: bool):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  rows, channels = x.shape
  num_blocks = src.shape[0]
  from_e4m3 = x_scales is not None
  operands = (x, x_scales) if from_e4m3 else (x,)
  operands = vary_like_operands(operands, operands)
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return pl.pallas_call(
      functools.partial(_column_blocks_kernel, last=num_blocks - 1, from_e4m3=from_e4m3,
                        interpret=interpret),
      grid=(num_blocks, channels // BLOCK),
      in_specs=[pl.no_block_spec] * (2 + len(operands)),
      out_specs=[pl.BlockSpec((BLOCK, BLOCK), lambda b, c: (c, b)),
                 pl.BlockSpec((1, BLOCK), lambda b, c: (b, c))],
      out_shape=[jax.ShapeDtypeStruct((channels, num_blocks * BLOCK), jnp.float8_e4m3fn,
                                      manual_axis_type=manual),
                 jax.ShapeDtypeStruct((num_blocks, channels), jnp.float32,
                                      manual_axis_type=manual)],
      compiler_params=plgpu.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
      interpret=interpret, name="jax_ep_fp8_quantize_columns",
  )(src, count, *operands)


# ------------------------------------------------------------------------------------------
# An fp8 dispatch's rows back in bf16 (or another dtype), where they are inside the groups.

def _dequantize_rows_kernel(inside_ref, x_ref, scales_ref, out_ref):
  """One `[rows, 128]` block: `x * scale` rounded once to the output's dtype, where the
  block holds a row inside the groups; else nothing is read or written."""
  from jax.experimental import pallas as pl

  @pl.when(inside_ref[pl.program_id(0)] != 0)
  def _():
    x = x_ref[...].astype(jnp.float32)
    out_ref[...] = (x * scales_ref[...]).astype(out_ref.dtype)


def dequantize_row_blocks(x, scales, group_sizes, group_offsets, dtype, *,
                          interpret: bool = False):
  """`x` `[R, H]` e4m3 times its float32 `scales` `[R, H / 128]`, rounded once to `dtype`, in
  the blocks of `rows_per_program(R)` rows that hold a row inside the groups (`group_sizes`
  `[L]`, `group_offsets` `[L]` or None: contiguous from row 0): `dequantize`'s rule, bit for
  bit; the other blocks' rows are not written (unspecified). R a multiple of 8 and H of 128,
  checked by the caller.

  NOTES: an fp8 dispatch's buffer holds the worst-case capacity, most of it past the groups:
  XLA's elementwise dequantisation reads and writes every row of it, this only the blocks
  that hold received rows."""
  from jax_ep.experts.layout import blocks_inside_groups
  inside = blocks_inside_groups(group_sizes, group_offsets, x.shape[0],
                                rows_per_program(x.shape[0])).astype(jnp.int32)
  return _run(functools.partial(_dequantize_rows, dtype=dtype), x, scales, inside,
              interpret=interpret)


def _dequantize_rows(x, scales, inside, *, dtype, interpret: bool):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  rows, hidden = x.shape
  block_rows = rows_per_program(rows)
  x, scales = vary_like_operands((x, scales), (x, scales, inside))
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return pl.pallas_call(
      _dequantize_rows_kernel,
      grid=(rows // block_rows, hidden // BLOCK),
      in_specs=[pl.no_block_spec, pl.BlockSpec((block_rows, BLOCK), lambda i, j: (i, j)),
                pl.BlockSpec((block_rows, 1), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((block_rows, BLOCK), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((rows, hidden), dtype, manual_axis_type=manual),
      compiler_params=plgpu.CompilerParams(num_warps=_ROW_WARPS, num_stages=1),
      interpret=interpret, name="jax_ep_fp8_dequantize_rows",
  )(inside, x, scales)
