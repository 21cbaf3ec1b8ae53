"""Differentiable per-shard ops built on a backend: custom_vjp rules shared by all backends.

- dispatch is linear in `x`: its transpose is the unweighted combine of the cotangent.
- the weighted combine is linear in `expert_out`: its transpose is a dispatch of `d_out` scaled
  per slot by the weight; the `topk_weights` cotangent is `<d_out[t], expert_out[row(t, k)]>`.
- the unweighted combine's transpose is the plain dispatch.
Routing metadata is integer-valued and gets no cotangent.
"""

from __future__ import annotations

import functools

import jax

from jax_ep._varying import sum_to_primal


def _no_cotangent(tree):
  return jax.tree.map(lambda _: None, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dispatch_tokens(backend, x, topk_idx, topk_weights):
  """`(recv_x, group_sizes, num_dropped, num_invalid, routing)`; differentiable in `x` only.

  The router weights reach the loss through `combine` (the handle carries them), so dispatch
  gives them no cotangent of its own.
  """
  return backend.dispatch_tokens(x, topk_idx, topk_weights)


def _dispatch_tokens_fwd(backend, x, topk_idx, topk_weights):
  outs = backend.dispatch_tokens(x, topk_idx, topk_weights)
  return outs, (outs[-1], x)


def _dispatch_tokens_bwd(backend, residuals, cotangents):
  routing, x = residuals
  d_recv_x = cotangents[0]
  return sum_to_primal(backend.combine(d_recv_x, routing), x), None, None


dispatch_tokens.defvjp(_dispatch_tokens_fwd, _dispatch_tokens_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine_weighted(backend, expert_out, topk_weights, routing):
  return backend.combine(expert_out, routing, topk_weights)


def _combine_weighted_fwd(backend, expert_out, topk_weights, routing):
  out = backend.combine(expert_out, routing, topk_weights)
  return out, (expert_out, topk_weights, routing)


def _combine_weighted_bwd(backend, residuals, d_out):
  expert_out, topk_weights, routing = residuals
  d_expert_out, d_weights = backend.combine_vjp(d_out, expert_out, routing, topk_weights)
  # NOTES: inside shard_map a cotangent must vary over the axes its primal does, no more:
  # an input shared over some axes (weights made inside the body, say) gets their sum.
  return (sum_to_primal(d_expert_out, expert_out),
          sum_to_primal(d_weights.astype(topk_weights.dtype), topk_weights),
          _no_cotangent(routing))


combine_weighted.defvjp(_combine_weighted_fwd, _combine_weighted_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def combine_unweighted(backend, expert_out, routing):
  return backend.combine(expert_out, routing)


def _combine_unweighted_fwd(backend, expert_out, routing):
  return backend.combine(expert_out, routing), (routing, expert_out)


def _combine_unweighted_bwd(backend, residuals, d_out):
  routing, expert_out = residuals
  return sum_to_primal(backend.dispatch(d_out, routing), expert_out), _no_cotangent(routing)


combine_unweighted.defvjp(_combine_unweighted_fwd, _combine_unweighted_bwd)
