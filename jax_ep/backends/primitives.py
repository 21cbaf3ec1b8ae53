"""Differentiable per-shard ops built on a backend: custom_vjp rules shared by all backends.

They see a backend through the `Backend` protocol (jax_ep/backends/base.py) alone.

- dispatch is linear in `x`: its transpose is the unweighted combine of the cotangent.
- the fp8 dispatch passes the gradient straight through its quantisation (as DeepSeek-V3
  trains): the cotangent of its e4m3 rows is taken in the group's dtype as that of the rows
  they stand for (`dequantize` gives it so), and its transpose is the same unweighted combine.
- the weighted combine is linear in `expert_out`: its transpose is a dispatch of `d_out` scaled
  per slot by the weight; the `topk_weights` cotangent is `<d_out[t], expert_out[row(t, k)]>`.
- the unweighted combine's transpose is the plain dispatch along the same layout
  (`dispatch_cached`).
The layout (where dispatch put each row) is integer-valued and gets no cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ep._native.varying import sum_to_primal
from jax_ep.backends.base import Backend
from jax_ep._native.fp8 import fp8_quantize, pack_ue8m0, straight_through, unpack_ue8m0
from jax_ep.config import RowFormat


def _no_cotangent(tree):
  return jax.tree.map(lambda _: None, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dispatch(backend: Backend, x, topk_idx, topk_weights):
  """`(recv_x, group_sizes, num_dropped, num_invalid, layout)`; differentiable in `x` only.

  The router weights reach the loss through `combine` (the handle carries them), so dispatch
  gives them no cotangent of its own.
  """
  return backend.dispatch(x, topk_idx, topk_weights)


def _dispatch_fwd(backend: Backend, x, topk_idx, topk_weights):
  outs = backend.dispatch(x, topk_idx, topk_weights)
  return outs, (outs[-1], x)


def _dispatch_bwd(backend: Backend, residuals, cotangents):
  layout, x = residuals
  d_recv_x = cotangents[0]
  return sum_to_primal(backend.combine(d_recv_x, layout), x), None, None


dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# NOTES: an e4m3 row's cotangent is carried in the group's dtype, never in float8 (3 mantissa
# bits, and values past 448 turn into NaN): `dequantize` returns the cotangent of the rows it
# made as its e4m3 input's, and `dispatch_fp8` takes that as its rows' cotangent. JAX accepts a
# custom_vjp cotangent of another float dtype for a float input of the same shape (its
# `_temporary_dtype_exception`; tests/test_fp8_dispatch.py holds it to that under jit,
# shard_map, vmap and jax.checkpoint). A float8 cotangent (code that casts the rows itself)
# is widened and taken the same way, with its rounding.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dispatch_fp8(backend: Backend, x, x_scales, topk_idx, topk_weights):
  """`(recv_x e4m3, recv_scales, group_sizes, num_dropped, num_invalid, layout)` in the
  group's fp8 `wire_format`; differentiable in `x` (straight through the quantisation: the
  unweighted combine of the rows' cotangent, in the group's dtype). `x_scales` (given with
  e4m3 `x`) gets no cotangent; an e4m3 `x` gets its cotangent in the group's dtype."""
  return backend.dispatch_fp8(x, x_scales, topk_idx, topk_weights)


def _dispatch_fp8_fwd(backend: Backend, x, x_scales, topk_idx, topk_weights):
  outs = backend.dispatch_fp8(x, x_scales, topk_idx, topk_weights)
  return outs, (outs[-1], x)


def _dispatch_fp8_bwd(backend: Backend, residuals, cotangents):
  layout, x = residuals
  d_rows = cotangents[0].astype(backend.config.dtype)
  return sum_to_primal(backend.combine(d_rows, layout), x), None, None, None


dispatch_fp8.defvjp(_dispatch_fp8_fwd, _dispatch_fp8_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 5))
def dequantize(x, scales, dtype, group_sizes=None, group_offsets=None, kernel=None):
  """e4m3 rows `x` `[..., H]` times their `scales`, one per 128 channels (`[..., H/128]`
  float32, or `[..., H/512]` int32 UE8M0 exponents), rounded once to `dtype`. Its cotangent
  passes straight through to `x`, in `dtype` (see the NOTES above); `scales` get none.
  `kernel(x, scales, group_sizes, group_offsets, dtype)` (rows `[R, H]`, float32 scales), where
  the caller gives one, computes the rows inside the groups alone (the others unspecified):
  jax_ep's kernel on Hopper GPUs, where XLA reads and writes every row of a worst-case
  capacity."""
  if scales.dtype == jnp.int32:
    scales = unpack_ue8m0(scales)
  scales = scales.astype(jnp.float32)
  if kernel is not None:
    return kernel(x, scales, group_sizes, group_offsets, jnp.dtype(dtype))
  x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], scales.shape[-1], -1)
  return (x32 * scales[..., None]).reshape(x.shape).astype(dtype)


def _dequantize_fwd(x, scales, dtype, group_sizes=None, group_offsets=None, kernel=None):
  return dequantize(x, scales, dtype, group_sizes, group_offsets, kernel), None


def _dequantize_bwd(dtype, kernel, residuals, d_out):
  del dtype, kernel, residuals
  return d_out, None, None, None


dequantize.defvjp(_dequantize_fwd, _dequantize_bwd)


def quantize(x, row_format: RowFormat):
  """`(q [..., H] float8_e4m3fn, scales)` of `x` in the fp8 `row_format`, the dispatches'
  rounding (`fp8.fp8_quantize`; UE8M0 scales packed). Straight through: the rows'
  cotangent (in any float dtype) comes back as `x`'s, in `x`'s dtype."""
  return _quantizer(row_format)(x)


@functools.cache
def _quantizer(row_format: RowFormat):
  def quantise(x):
    q, scales = fp8_quantize(x, round_scale=row_format.pow2_scales)
    return q, (pack_ue8m0(scales) if row_format.ue8m0 else scales)
  return straight_through(quantise)


def combine(backend: Backend, expert_out, layout, topk_weights=None):
  """`[T, H]`: weighted by `topk_weights` `[T, K]` (differentiable in both), or unweighted
  when it is None (the transpose of `dispatch`)."""
  if topk_weights is None:
    return _combine_unweighted(backend, expert_out, layout)
  return _combine_weighted(backend, expert_out, topk_weights, layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_weighted(backend: Backend, expert_out, topk_weights, layout):
  return backend.combine(expert_out, layout, topk_weights)


def _combine_weighted_fwd(backend: Backend, expert_out, topk_weights, layout):
  out = backend.combine(expert_out, layout, topk_weights)
  return out, (expert_out, topk_weights, layout)


def _combine_weighted_bwd(backend: Backend, residuals, d_out):
  expert_out, topk_weights, layout = residuals
  d_expert_out, d_topk_weights = backend.combine_vjp(d_out, expert_out, layout, topk_weights)
  # NOTES: inside shard_map a cotangent must vary over the axes its primal does, no more:
  # an input shared over some axes (weights made inside the body, say) gets their sum.
  return (sum_to_primal(d_expert_out, expert_out),
          sum_to_primal(d_topk_weights.astype(topk_weights.dtype), topk_weights),
          _no_cotangent(layout))


_combine_weighted.defvjp(_combine_weighted_fwd, _combine_weighted_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine_unweighted(backend: Backend, expert_out, layout):
  return backend.combine(expert_out, layout)


def _combine_unweighted_fwd(backend: Backend, expert_out, layout):
  return backend.combine(expert_out, layout), (layout, expert_out)


def _combine_unweighted_bwd(backend: Backend, residuals, d_out):
  layout, expert_out = residuals
  return (sum_to_primal(backend.dispatch_cached(d_out, layout), expert_out),
          _no_cotangent(layout))


_combine_unweighted.defvjp(_combine_unweighted_fwd, _combine_unweighted_bwd)


# ------------------------------------------------------------------------------- low latency
# NOTES: the reference backend's low-latency pair is plain JAX, differentiated as written. The
# kernels' gradients follow the same rules as the high-throughput pair: dispatch's transpose is
# the unweighted low-latency combine (every kept slot weight 1: duplicates were merged before),
# combine's is a dispatch of d_out scaled per slot plus the slot dots, from the rows gathered
# home (`gather`). Rows of a slab past `count` carry no data: their cotangent is zero.

def low_latency_dispatch(backend: Backend, x, topk_idx, row_format: RowFormat):
  """`(recv_x, scales, count, num_dropped, num_invalid, layout)`; differentiable in `x`."""
  if not backend.low_latency_kernels:
    return backend.low_latency_dispatch(x, topk_idx, row_format)
  return _ll_dispatch(backend, row_format, x, topk_idx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ll_dispatch(backend: Backend, row_format: RowFormat, x, topk_idx):
  return backend.low_latency_dispatch(x, topk_idx, row_format)


def _ll_dispatch_fwd(backend: Backend, row_format: RowFormat, x, topk_idx):
  outs = backend.low_latency_dispatch(x, topk_idx, row_format)
  return outs, (outs[-1], x)


def _ll_dispatch_bwd(backend: Backend, row_format: RowFormat, residuals, cotangents):
  if row_format.is_fp8:
    raise NotImplementedError(
        f"jax_ep.low_latency_dispatch: row_format={row_format} has no gradient on the cuda "
        f"backend (the rows are quantised); differentiate a RowFormat.PLAIN dispatch, or use "
        f"backend='reference'")
  layout, x = residuals
  valid = (layout.topk_idx >= 0) & (layout.topk_idx < backend.config.num_experts)
  dx = backend.low_latency_combine(cotangents[0], layout, valid.astype(jnp.float32))
  return sum_to_primal(dx.astype(x.dtype), x), None


_ll_dispatch.defvjp(_ll_dispatch_fwd, _ll_dispatch_bwd)


def low_latency_combine(backend: Backend, expert_out, layout, topk_weights):
  """`[T, H]`; differentiable in `expert_out` and `topk_weights`."""
  if not backend.low_latency_kernels:
    return backend.low_latency_combine(expert_out, layout, topk_weights)
  return _ll_combine(backend, expert_out, topk_weights, layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_combine(backend: Backend, expert_out, topk_weights, layout):
  return backend.low_latency_combine(expert_out, layout, topk_weights)


def _ll_combine_fwd(backend: Backend, expert_out, topk_weights, layout):
  out = backend.low_latency_combine(expert_out, layout, topk_weights)
  return out, (expert_out, topk_weights, layout)


def _ll_combine_bwd(backend: Backend, residuals, d_out):
  expert_out, topk_weights, layout = residuals
  d_out = d_out.astype(expert_out.dtype)
  d_rows = backend.low_latency_dispatch(d_out, layout.topk_idx, RowFormat.PLAIN,
                                        topk_weights=topk_weights.astype(jnp.float32))[0]
  slab = d_rows.shape[1]
  used = jnp.arange(slab, dtype=jnp.int32)[None, :, None] < layout.count[:, None, None]
  d_expert_out = jnp.where(used, d_rows, jnp.zeros((), d_rows.dtype))
  rows = backend.low_latency_combine(expert_out, layout, None, gather=True)  # [T, K, H]
  d_topk_weights = jnp.einsum("tkh,th->tk", rows.astype(jnp.float32),
                              d_out.astype(jnp.float32))
  return (sum_to_primal(d_expert_out, expert_out),
          sum_to_primal(d_topk_weights.astype(topk_weights.dtype), topk_weights),
          _no_cotangent(layout))


_ll_combine.defvjp(_ll_combine_fwd, _ll_combine_bwd)
