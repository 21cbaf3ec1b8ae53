"""Dense reference MoE: all tokens in one place, no communication, differentiable `jnp`.

Computes every expert on every token (cost `N * E * H * F`), so it is meant for test and demo
sizes. The math matches `jax_ep.mlp.expert_mlp` (SwiGLU, GeGLU, GELU or SiLU, fp32
accumulation, the hidden activation rounded to the compute dtype), `jax_ep.combine` (weighted
sum over the top-k slots in fp32, slots with ids outside `[0, E)` contribute nothing) and the
layer's casts (weights and activations to the compute dtype, the output back to `x`'s).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ep.layer import MoEParams
from jax_ep.routing import Routing, route

# act(gate) * up for the gated activations, act(h) for the plain ones (jax.nn.gelu's default,
# tanh-approximated GELU, as the layer documents).
_ACTIVATIONS = {"swiglu": (jax.nn.silu, True), "geglu": (jax.nn.gelu, True),
                "gelu": (jax.nn.gelu, False), "silu": (jax.nn.silu, False)}


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


def _mlp(x, w_gate, w_up, w_down, activation: str, spec_in: str, spec_out: str):
  """One MLP per weight slice: two einsums around the activation, fp32 accumulation, the
  hidden activation and the result rounded to `x.dtype`."""
  f32 = jnp.float32
  act, gated = _ACTIVATIONS[activation]
  h = act(jnp.einsum(spec_in, x, w_gate, preferred_element_type=f32))
  if gated:
    h = h * jnp.einsum(spec_in, x, w_up, preferred_element_type=f32)
  return jnp.einsum(spec_out, h.astype(x.dtype), w_down,
                    preferred_element_type=f32).astype(x.dtype)


def _all_experts(params: MoEParams, x, activation: str):
  """Every expert applied to every token: `x [N, H]` -> `[E, N, H]` in `x.dtype`."""
  return _mlp(x, params.w_gate, params.w_up, params.w_down, activation, "nh,ehf->enf",
              "enf,efh->enh")


def dense_moe(params: MoEParams, x, topk_idx, topk_weights, *, capacity_free: bool = True,
              activation: str = "swiglu", dtype=None):
  """The MoE layer with given routing, computed densely.

  Args:
    params: global `MoEParams` (`router` is unused here): `w_gate` (and `w_up` for the gated
      activations) `[E, H, F]`, `w_down` `[E, F, H]`, any floating dtype.
    x: `[N, H]` activations (bf16, f16 or f32), all ranks' tokens together.
    topk_idx: `[N, K]` int32 expert ids; ids outside `[0, E)` (e.g. -1) select nothing.
    topk_weights: `[N, K]` float32 router weights.
    capacity_free: must be True: the dense model never drops rows, so it equals an
      expert-parallel layer only when that layer's capacity was large enough (the default).
    activation: "swiglu", "geglu", "gelu" or "silu".
    dtype: the compute dtype (the group's): `x` and the weights are cast to it, the output
      back to `x`'s dtype. None: `x`'s dtype.

  Returns:
    `[N, H]` in `x.dtype`: `out[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t])`, accumulated in
    float32.
  """
  if not capacity_free:
    raise NotImplementedError("dense_moe models a layer that never drops rows (capacity_free=True)")
  if activation not in _ACTIVATIONS:
    raise ValueError(f"dense_moe: activation must be one of {list(_ACTIVATIONS)}, got "
                     f"{activation!r}")
  params = MoEParams(*(None if p is None else _replicated(p) for p in params))
  x, topk_idx, topk_weights = (_replicated(a) for a in (x, topk_idx, topk_weights))
  out_dtype = x.dtype
  dtype = x.dtype if dtype is None else dtype
  x = x.astype(dtype)
  params = params._replace(**{name: getattr(params, name).astype(dtype)
                              for name in ("w_gate", "w_up", "w_down", "shared_gate", "shared_up",
                                           "shared_down")
                              if getattr(params, name) is not None})
  num_experts = params.w_gate.shape[0]
  ys = _all_experts(params, x, activation)  # [E, N, H]
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  safe = jnp.where(valid, topk_idx, 0)
  tokens = jnp.arange(x.shape[0])[:, None]
  picked = ys[safe, tokens].astype(jnp.float32)  # [N, K, H]
  w = jnp.where(valid, topk_weights.astype(jnp.float32), 0.0)
  out = jnp.einsum("nk,nkh->nh", w, picked).astype(x.dtype)
  if params.shared_gate is not None:
    out = out + _mlp(x, params.shared_gate, params.shared_up, params.shared_down, activation,
                     "nh,hf->nf", "nf,fh->nh")
  return out.astype(out_dtype)


def dense_moe_layer(params: MoEParams, x, num_topk: int, routing: Routing = Routing(), *,
                    activation: str = "swiglu", dtype=None):
  """Router (`jax_ep.routing.route` on `x` as given, float32, with `params.router_bias`) then
  `dense_moe`: the dense twin of `jax_ep.moe_mlp`.

  Args:
    params: global `MoEParams`, `router` `[H, E]`.
    x: `[N, H]` activations.
    num_topk: `K`.
    routing: the `Routing` of the layer it stands in for.
    activation, dtype: as in `dense_moe` (`dtype`: the group's dtype of the layer it stands
      in for).

  Returns:
    `[N, H]` in `x.dtype`.
  """
  x = _replicated(x)
  bias = None if params.router_bias is None else _replicated(params.router_bias)
  topk_idx, topk_weights = route(x, _replicated(params.router), num_topk, routing, bias)
  return dense_moe(params, x, topk_idx, topk_weights, activation=activation, dtype=dtype)
