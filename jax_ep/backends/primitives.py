"""Differentiable per-shard ops built on a backend: custom_vjp rules shared by all backends.

They see a backend through the `Backend` protocol (jax_ep/backends/base.py) alone.

- dispatch is linear in `x`: its transpose is the unweighted combine of the cotangent.
- the weighted combine is linear in `expert_out`: its transpose is a dispatch of `d_out` scaled
  per slot by the weight; the `topk_weights` cotangent is `<d_out[t], expert_out[row(t, k)]>`.
- the unweighted combine's transpose is the plain dispatch.
Routing metadata is integer-valued and gets no cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ep._native.varying import sum_to_primal
from jax_ep.backends.base import Backend


def _no_cotangent(tree):
  return jax.tree.map(lambda _: None, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dispatch_tokens(backend: Backend, x, topk_idx, topk_weights):
  """`(recv_x, group_sizes, num_dropped, num_invalid, routing)`; differentiable in `x` only.

  The router weights reach the loss through `combine` (the handle carries them), so dispatch
  gives them no cotangent of its own.
  """
  return backend.dispatch_tokens(x, topk_idx, topk_weights)


def _dispatch_tokens_fwd(backend: Backend, x, topk_idx, topk_weights):
  outs = backend.dispatch_tokens(x, topk_idx, topk_weights)
  return outs, (outs[-1], x)


def _dispatch_tokens_bwd(backend: Backend, residuals, cotangents):
  routing, x = residuals
  d_recv_x = cotangents[0]
  return sum_to_primal(backend.combine(d_recv_x, routing), x), None, None


dispatch_tokens.defvjp(_dispatch_tokens_fwd, _dispatch_tokens_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine_weighted(backend: Backend, expert_out, topk_weights, routing):
  return backend.combine(expert_out, routing, topk_weights)


def _combine_weighted_fwd(backend: Backend, expert_out, topk_weights, routing):
  out = backend.combine(expert_out, routing, topk_weights)
  return out, (expert_out, topk_weights, routing)


def _combine_weighted_bwd(backend: Backend, residuals, d_out):
  expert_out, topk_weights, routing = residuals
  d_expert_out, d_weights = backend.combine_vjp(d_out, expert_out, routing, topk_weights)
  # NOTES: inside shard_map a cotangent must vary over the axes its primal does, no more:
  # an input shared over some axes (weights made inside the body, say) gets their sum.
  return (sum_to_primal(d_expert_out, expert_out),
          sum_to_primal(d_weights.astype(topk_weights.dtype), topk_weights),
          _no_cotangent(routing))


combine_weighted.defvjp(_combine_weighted_fwd, _combine_weighted_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine_unweighted(backend: Backend, expert_out, routing):
  return backend.combine(expert_out, routing)


def _combine_unweighted_fwd(backend: Backend, expert_out, routing):
  return backend.combine(expert_out, routing), (routing, expert_out)


def _combine_unweighted_bwd(backend: Backend, residuals, d_out):
  routing, expert_out = residuals
  return sum_to_primal(backend.dispatch(d_out, routing), expert_out), _no_cotangent(routing)


combine_unweighted.defvjp(_combine_unweighted_fwd, _combine_unweighted_bwd)


# ------------------------------------------------------------------------------- low latency
# NOTES: the reference backend's low-latency pair is plain JAX, differentiated as written. The
# kernels' gradients follow the same rules as the high-throughput pair: dispatch's transpose is
# the unweighted low-latency combine (every kept slot weight 1: duplicates were merged before),
# combine's is a dispatch of d_out scaled per slot plus the slot dots, from the rows gathered
# home (`gather`). Rows of a slab past `count` carry no data: their cotangent is zero.

def low_latency_dispatch(backend: Backend, x, topk_idx, fp8):
  """`(recv_x, scales, count, num_dropped, num_invalid, routing)`; differentiable in `x`."""
  if not backend.low_latency_kernels:
    return backend.low_latency_dispatch(x, topk_idx, fp8)
  return _ll_dispatch(backend, fp8, x, topk_idx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ll_dispatch(backend: Backend, fp8, x, topk_idx):
  return backend.low_latency_dispatch(x, topk_idx, fp8)


def _ll_dispatch_fwd(backend: Backend, fp8, x, topk_idx):
  outs = backend.low_latency_dispatch(x, topk_idx, fp8)
  return outs, (outs[-1], x)


def _ll_dispatch_bwd(backend: Backend, fp8, residuals, cotangents):
  if fp8 is not None:
    raise NotImplementedError(
        "jax_ep.low_latency_dispatch: use_fp8=True has no gradient on the cuda backend (the "
        "rows are quantised); differentiate a bf16 dispatch, or use backend='reference'")
  routing, x = residuals
  valid = (routing.topk_idx >= 0) & (routing.topk_idx < backend.config.num_experts)
  dx = backend.low_latency_combine(cotangents[0], routing, valid.astype(jnp.float32))
  return sum_to_primal(dx.astype(x.dtype), x), None


_ll_dispatch.defvjp(_ll_dispatch_fwd, _ll_dispatch_bwd)


def low_latency_combine(backend: Backend, expert_out, routing, topk_weights):
  """`[T, H]`; differentiable in `expert_out` and `topk_weights`."""
  if not backend.low_latency_kernels:
    return backend.low_latency_combine(expert_out, routing, topk_weights)
  return _ll_combine(backend, expert_out, topk_weights, routing)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_combine(backend: Backend, expert_out, topk_weights, routing):
  return backend.low_latency_combine(expert_out, routing, topk_weights)


def _ll_combine_fwd(backend: Backend, expert_out, topk_weights, routing):
  out = backend.low_latency_combine(expert_out, routing, topk_weights)
  return out, (expert_out, topk_weights, routing)


def _ll_combine_bwd(backend: Backend, residuals, d_out):
  expert_out, topk_weights, routing = residuals
  d_out = d_out.astype(expert_out.dtype)
  d_rows = backend.low_latency_dispatch(d_out, routing.topk_idx, None,
                                        slot_scale=topk_weights.astype(jnp.float32))[0]
  slab = d_rows.shape[1]
  used = jnp.arange(slab, dtype=jnp.int32)[None, :, None] < routing.count[:, None, None]
  d_expert_out = jnp.where(used, d_rows, jnp.zeros((), d_rows.dtype))
  rows = backend.low_latency_combine(expert_out, routing, None, gather=True)  # [T, K, H]
  d_weights = jnp.einsum("tkh,th->tk", rows.astype(jnp.float32), d_out.astype(jnp.float32))
  return (sum_to_primal(d_expert_out, expert_out),
          sum_to_primal(d_weights.astype(topk_weights.dtype), topk_weights),
          _no_cotangent(routing))


_ll_combine.defvjp(_ll_combine_fwd, _ll_combine_bwd)
