"""Dense reference MoE: all tokens in one place, no communication, differentiable `jnp`.

Computes every expert on every token (cost `N * E * H * F`), so it is meant for test and demo
sizes. The math matches `jax_ep.layer.expert_mlp` (SwiGLU, fp32 accumulation, the hidden
activation rounded to the activation dtype) and `jax_ep.combine` (weighted sum over the top-k
slots in fp32, slots with ids outside `[0, E)` contribute nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ep.layer import MoEParams, shared_mlp
from jax_ep.routing import Routing, route


def _replicated(a):
  """`a` laid out whole on every device of its mesh when it is split over Explicit mesh axes.

  With Explicit axes (the default of `jax.make_mesh`) gathers over a sharded expert axis have no
  unambiguous output sharding; the dense model has no use for the split, so it undoes it. Arrays
  on Auto axes or on one device are returned as they are.
  """
  sharding = jax.typeof(a).sharding
  spec = getattr(sharding, "spec", None)
  if spec is not None and any(s is not None for s in spec):
    return jax.reshard(a, sharding.update(spec=P()))
  return a


def _all_experts(params: MoEParams, x):
  """Every expert applied to every token: `x [N, H]` -> `[E, N, H]` in `x.dtype`."""
  f32 = jnp.float32
  gate = jnp.einsum("nh,ehf->enf", x, params.w_gate, preferred_element_type=f32)
  up = jnp.einsum("nh,ehf->enf", x, params.w_up, preferred_element_type=f32)
  h = (jax.nn.silu(gate) * up).astype(x.dtype)
  y = jnp.einsum("enf,efh->enh", h, params.w_down, preferred_element_type=f32)
  return y.astype(x.dtype)


def dense_moe(params: MoEParams, x, topk_idx, topk_weights, *, capacity_free: bool = True):
  """The MoE layer with given routing, computed densely.

  Args:
    params: global `MoEParams` (`router` is unused here): `w_gate`/`w_up` `[E, H, F]`,
      `w_down` `[E, F, H]` in the activation dtype.
    x: `[N, H]` activations (bf16, f16 or f32), all ranks' tokens together.
    topk_idx: `[N, K]` int32 expert ids; ids outside `[0, E)` (e.g. -1) select nothing.
    topk_weights: `[N, K]` float32 router weights.
    capacity_free: must be True: the dense model never drops rows, so it equals an
      expert-parallel layer only when that layer's capacity was large enough (the default).

  Returns:
    `[N, H]` in `x.dtype`: `out[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t])`, accumulated in
    float32.
  """
  if not capacity_free:
    raise NotImplementedError("dense_moe models a layer that never drops rows (capacity_free=True)")
  params = MoEParams(*(None if p is None else _replicated(p) for p in params))
  x, topk_idx, topk_weights = (_replicated(a) for a in (x, topk_idx, topk_weights))
  num_experts = params.w_gate.shape[0]
  ys = _all_experts(params, x)  # [E, N, H]
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  safe = jnp.where(valid, topk_idx, 0)
  tokens = jnp.arange(x.shape[0])[:, None]
  picked = ys[safe, tokens].astype(jnp.float32)  # [N, K, H]
  w = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)
  out = jnp.einsum("nk,nkh->nh", w, picked).astype(x.dtype)
  if params.shared_gate is not None:
    out = out + shared_mlp(x, params.shared_gate, params.shared_up, params.shared_down)
  return out


def dense_moe_layer(params: MoEParams, x, num_topk: int, routing: Routing = Routing()):
  """Router (`jax_ep.routing.route`, with `params.router_bias`) then `dense_moe`: the dense
  twin of `jax_ep.moe_mlp`.

  Args:
    params: global `MoEParams`, `router` `[H, E]` float32.
    x: `[N, H]` activations.
    num_topk: `K`.
    routing: the `Routing` of the layer it stands in for.

  Returns:
    `[N, H]` in `x.dtype`.
  """
  x = _replicated(x)
  bias = None if params.router_bias is None else _replicated(params.router_bias)
  topk_idx, topk_weights = route(x, _replicated(params.router), num_topk, routing, bias)
  return dense_moe(params, x, topk_idx, topk_weights)
