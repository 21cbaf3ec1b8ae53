"""A whole MoE layer on top of dispatch/combine: router -> top-k -> dispatch -> expert MLP
(`jax.lax.ragged_dot`, SwiGLU) -> combine.

`moe_mlp` takes global arrays and enters `shard_map` itself; `moe_mlp_per_shard` is the body, for
models that are already inside a `shard_map`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ep import ops
from jax_ep.group import Group


class MoEParams(NamedTuple):
  """Weights of one MoE layer (global shapes; experts are sharded over the EP axis).

  Attributes:
    router: `[H, E]` float32, replicated.
    w_gate: `[E, H, F]`, w_up: `[E, H, F]`, w_down: `[E, F, H]` in the activation dtype.
  """
  router: jax.Array
  w_gate: jax.Array
  w_up: jax.Array
  w_down: jax.Array


def init_moe_params(key, *, num_experts: int, hidden: int, ffn: int,
                    dtype=jnp.bfloat16) -> MoEParams:
  k_router, k_gate, k_up, k_down = jax.random.split(key, 4)
  scale_in, scale_out = hidden ** -0.5, ffn ** -0.5
  normal = jax.random.normal
  return MoEParams(
      router=normal(k_router, (hidden, num_experts), jnp.float32) * scale_in,
      w_gate=(normal(k_gate, (num_experts, hidden, ffn)) * scale_in).astype(dtype),
      w_up=(normal(k_up, (num_experts, hidden, ffn)) * scale_in).astype(dtype),
      w_down=(normal(k_down, (num_experts, ffn, hidden)) * scale_out).astype(dtype))


def route(x, router, num_topk: int):
  """Softmax router with top-k, weights renormalised over the chosen experts.

  Returns `(topk_idx [T, K] int32, topk_weights [T, K] float32)`.
  """
  logits = x.astype(jnp.float32) @ router
  probs = jax.nn.softmax(logits, axis=-1)
  weights, idx = jax.lax.top_k(probs, num_topk)
  weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return idx.astype(jnp.int32), weights


def expert_mlp(x, w_gate, w_up, w_down, group_sizes):
  """SwiGLU experts over expert-grouped rows: `[rows, H] -> [rows, H]` (fp32 accumulation)."""
  gate = jax.lax.ragged_dot(x, w_gate, group_sizes, preferred_element_type=jnp.float32)
  up = jax.lax.ragged_dot(x, w_up, group_sizes, preferred_element_type=jnp.float32)
  h = (jax.nn.silu(gate) * up).astype(x.dtype)
  return jax.lax.ragged_dot(h, w_down, group_sizes,
                            preferred_element_type=jnp.float32).astype(x.dtype)


def moe_mlp_per_shard(group: Group, params: MoEParams, x, topk_idx=None, topk_weights=None):
  """The layer body, inside `shard_map` over the group's axis.

  Args:
    group: the `Group`.
    params: this shard's `MoEParams` (router replicated; expert weights `[L, ...]`).
    x: `[T, H]` this rank's tokens.
    topk_idx, topk_weights: optional routing; computed from `params.router` when omitted.

  Returns:
    `(out [T, H], num_dropped [])`.
  """
  if topk_idx is None:
    topk_idx, topk_weights = route(x, params.router, group.num_topk)
  recv, handle = ops.dispatch(group, x, topk_idx, topk_weights)
  y = expert_mlp(recv.x, params.w_gate, params.w_up, params.w_down, recv.group_sizes)
  return ops.combine(group, y, handle), recv.num_dropped


def param_specs(axis_name: str) -> MoEParams:
  """PartitionSpecs of `MoEParams`: router replicated, experts split over `axis_name`."""
  experts = P(axis_name)
  return MoEParams(router=P(), w_gate=experts, w_up=experts, w_down=experts)


def moe_mlp(group: Group, params: MoEParams, x, topk_idx=None, topk_weights=None):
  """The whole layer on global arrays; enters `shard_map` over the group's axis.

  Args:
    group: the `Group`.
    params: global `MoEParams` (`E` experts).
    x: `[R * T, H]` tokens, split evenly over the EP axis (data-parallel attention layout).
    topk_idx, topk_weights: optional `[R * T, K]` routing (else the router in `params` decides).

  Returns:
    `(out [R * T, H], num_dropped [R])`, num_dropped per rank.
  """
  axis = group.axis_name
  tokens = P(axis)
  specs = param_specs(axis)

  constrain = group.constrain
  params = MoEParams(*(constrain(p, s) for p, s in zip(params, specs)))
  x = constrain(x, tokens)
  routing = ()
  if topk_idx is not None:
    routing = (constrain(topk_idx, tokens), constrain(topk_weights, tokens))

  def body(params, x, *routing):
    out, dropped = moe_mlp_per_shard(group, params, x, *routing)
    return out, dropped[None]

  in_specs = (specs, tokens) + (tokens,) * len(routing)
  return jax.shard_map(body, mesh=group.mesh, in_specs=in_specs,
                       out_specs=(tokens, P(axis)))(params, x, *routing)
