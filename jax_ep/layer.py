"""A whole MoE layer on dispatch/combine: router -> top-k -> dispatch -> SwiGLU experts
(`jax_ep.grouped_matmul`) -> combine, plus an optional shared expert, the auxiliary losses and
the per-expert counts.

`moe_mlp` takes global arrays (`[N, H]` or `[B, S, H]`, tokens split over every mesh axis,
experts over the group's) and enters `shard_map` itself; `moe_mlp_per_shard` is the body, for
models that are already inside a `shard_map`.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ep import ops, slab_mlp
from jax_ep.gmm import grouped_matmul
from jax_ep.group import Group
from jax_ep.routing import (Routing, expert_counts, load_balancing_loss, route,  # noqa: F401
                            route_logits, router_z_loss, update_router_bias)

_logger = logging.getLogger("jax_ep")
_SAID_SLABS: set[str] = set()


class MoEParams(NamedTuple):
  """Weights of one MoE layer (global shapes; experts are sharded over the EP axis).

  Attributes:
    router: `[H, E]` float32, replicated.
    w_gate, w_up: `[E, H, F]`; w_down: `[E, F, H]`, in the activation dtype.
    router_bias: optional `[E]` float32 selection bias (`Routing`; not trained by gradients:
      `update_router_bias` moves it), replicated.
    shared_gate, shared_up: optional `[H, Fs]`; shared_down: `[Fs, H]`: a dense SwiGLU expert
      every token goes through, added to the routed experts' output, replicated.
  """
  router: jax.Array
  w_gate: jax.Array
  w_up: jax.Array
  w_down: jax.Array
  router_bias: jax.Array | None = None
  shared_gate: jax.Array | None = None
  shared_up: jax.Array | None = None
  shared_down: jax.Array | None = None


class MoEOutput(NamedTuple):
  """What the layer returns. From `moe_mlp`, the statistics carry a leading axis of the shards
  (`[S]`, `[S, E]`, one entry per shard of tokens): mean the losses and sum the counts over it.

  Attributes:
    out: the layer's output, shaped like its input.
    num_dropped: rows that did not fit the receive capacity (0 at the default capacity).
    aux_loss: the load-balancing loss of the shard's tokens (`load_balancing_loss`; 1 when
      balanced); multiply by your coefficient.
    z_loss: the router z-loss of the shard's tokens (`router_z_loss`).
    expert_counts: `[E]` int32 slots of the shard's tokens routed to each expert.
  """
  out: jax.Array
  num_dropped: jax.Array
  aux_loss: jax.Array
  z_loss: jax.Array
  expert_counts: jax.Array


def init_moe_params(key, *, num_experts: int, hidden: int, ffn: int, dtype=jnp.bfloat16,
                    shared_ffn: int = 0, router_bias: bool = False) -> MoEParams:
  """Random weights: normal, scaled by the fan-in; a zero router bias if asked; a shared expert
  of inner size `shared_ffn` when it is positive."""
  k_router, k_gate, k_up, k_down, k_shared = jax.random.split(key, 5)
  scale_in, scale_out = hidden ** -0.5, ffn ** -0.5
  normal = jax.random.normal
  shared = {}
  if shared_ffn:
    ks = jax.random.split(k_shared, 3)
    shared = dict(
        shared_gate=(normal(ks[0], (hidden, shared_ffn)) * scale_in).astype(dtype),
        shared_up=(normal(ks[1], (hidden, shared_ffn)) * scale_in).astype(dtype),
        shared_down=(normal(ks[2], (shared_ffn, hidden)) * shared_ffn ** -0.5).astype(dtype))
  return MoEParams(
      router=normal(k_router, (hidden, num_experts), jnp.float32) * scale_in,
      w_gate=(normal(k_gate, (num_experts, hidden, ffn)) * scale_in).astype(dtype),
      w_up=(normal(k_up, (num_experts, hidden, ffn)) * scale_in).astype(dtype),
      w_down=(normal(k_down, (num_experts, ffn, hidden)) * scale_out).astype(dtype),
      router_bias=jnp.zeros((num_experts,), jnp.float32) if router_bias else None, **shared)


def expert_mlp(x, w_gate, w_up, w_down, group_sizes):
  """SwiGLU experts over expert-grouped rows: `[rows, H] -> [rows, H]` (fp32 accumulation, the
  hidden activation rounded to `x.dtype`); rows past `sum(group_sizes)` stay zero."""
  f32 = jnp.float32
  gate = grouped_matmul(x, w_gate, group_sizes, preferred_element_type=f32)
  up = grouped_matmul(x, w_up, group_sizes, preferred_element_type=f32)
  h = (jax.nn.silu(gate) * up).astype(x.dtype)
  return grouped_matmul(h, w_down, group_sizes, preferred_element_type=f32).astype(x.dtype)


def expert_mlp_slabs(rows, w_gate, w_up, w_down, count, *, impl: str = "auto"):
  """SwiGLU experts over the low-latency slabs: `[L, S, H] -> [L, S, H]`, expert `l` on the first
  `count[l]` rows of slab `l` (fp32 accumulation, the hidden activation rounded to the rows'
  dtype); rows past `count[l]` are unspecified, as the dispatch leaves them.

  On GPUs the experts stop at each count (jax_ep/slab_mlp.py: Pallas kernels that skip the row
  tiles past it, so decode computes `T * K` rows rather than `L * S`); elsewhere, and for slabs
  the kernels' tiles do not divide, a batched matmul over whole slabs with the padding masked.
  `impl`: "auto", "pallas", "interpret" (the kernels in Pallas's interpreter) or "dense"."""
  name = slab_mlp.resolve_impl(impl, rows.shape, w_gate.shape[2], rows.dtype)
  if name not in _SAID_SLABS:
    _SAID_SLABS.add(name)
    _logger.info("jax_ep.expert_mlp_slabs %s: %s", list(rows.shape), name)
  return slab_mlp.slab_mlp(rows, w_gate, w_up, w_down, count, impl=name)


def shared_mlp(x, w_gate, w_up, w_down):
  """The dense SwiGLU expert every token goes through, same precision as `expert_mlp`."""
  f32 = jnp.float32
  gate = jnp.dot(x, w_gate, preferred_element_type=f32)
  up = jnp.dot(x, w_up, preferred_element_type=f32)
  h = (jax.nn.silu(gate) * up).astype(x.dtype)
  return jnp.dot(h, w_down, preferred_element_type=f32).astype(x.dtype)


def moe_mlp_per_shard(group: Group, params: MoEParams, x, topk_idx=None, topk_weights=None,
                      *, routing: Routing = Routing(),
                      mode: str = "high_throughput") -> MoEOutput:
  """The layer body, inside `shard_map` over the group's axis.

  Args:
    group: the `Group`.
    params: this shard's `MoEParams` (router, bias and shared expert replicated; expert
      weights `[L, ...]`).
    x: `[T, H]` this shard's tokens.
    topk_idx, topk_weights: optional routing (float32, or bf16 / f16, cast to float32); the
      router in `params` decides when they are omitted (the losses are then its, else zero).
    routing: how the router picks experts (`Routing`).
    mode: "high_throughput" (`dispatch` / `combine`, experts on expert-grouped rows) or
      "low_latency" (the decode pair, experts on the `[L, R*T_max, H]` slabs; the group needs
      `low_latency=True` on the cuda backend).

  Returns:
    `MoEOutput` with scalars and `[E]` counts for this shard.
  """
  if mode not in ("high_throughput", "low_latency"):
    raise ValueError(f"jax_ep.moe_mlp: mode must be 'high_throughput' or 'low_latency', got "
                     f"{mode!r}")
  zero = jnp.zeros((), jnp.float32)
  aux, z = zero, zero
  if topk_idx is None:
    logits = x.astype(jnp.float32) @ params.router.astype(jnp.float32)
    routed = route_logits(logits, group.num_topk, routing, params.router_bias)
    topk_idx, topk_weights = routed.topk_idx, routed.topk_weights
    aux = load_balancing_loss(routed.probs, topk_idx)
    z = router_z_loss(routed.logits)
  if mode == "low_latency":
    recv, handle = ops.low_latency_dispatch(group, x, topk_idx)
    y = expert_mlp_slabs(recv.x, params.w_gate, params.w_up, params.w_down, recv.count)
    out = ops.low_latency_combine(group, y, handle, topk_weights.astype(jnp.float32))
  else:
    recv, handle = ops.dispatch(group, x, topk_idx, topk_weights)
    y = expert_mlp(recv.x, params.w_gate, params.w_up, params.w_down, recv.group_sizes)
    out = ops.combine(group, y, handle)
  if params.shared_gate is not None:
    out = out + shared_mlp(x, params.shared_gate, params.shared_up, params.shared_down)
  return MoEOutput(out, recv.num_dropped, aux, z, expert_counts(topk_idx, group.num_experts))


def param_specs(axis_name: str, params: MoEParams | None = None) -> MoEParams:
  """PartitionSpecs of `MoEParams`: experts split over `axis_name`, everything else
  replicated (None where `params` has no such field)."""
  experts = P(axis_name)
  specs = MoEParams(router=P(), w_gate=experts, w_up=experts, w_down=experts, router_bias=P(),
                    shared_gate=P(), shared_up=P(), shared_down=P())
  if params is None:
    return specs
  return MoEParams(*(None if p is None else s for p, s in zip(params, specs)))


def _token_axes(group: Group):
  """Every mesh axis, the group's last: tokens are split over all of them (data parallel
  replicas beside the EP axis each get their own tokens)."""
  others = tuple(a for a in group.mesh.axis_names if a != group.axis_name)
  return (*others, group.axis_name)


def moe_mlp(group: Group, params: MoEParams, x, topk_idx=None, topk_weights=None, *,
            routing: Routing = Routing(), mode: str = "high_throughput") -> MoEOutput:
  """The whole layer on global arrays; enters `shard_map` over the group's mesh.

  Args:
    group: the `Group`.
    params: global `MoEParams` (`E` experts).
    x: `[N, H]` or `[B, S, H]` tokens. They are split evenly over every axis of the group's
      mesh (the EP axis and, beside it, data axes): each of the `M` shards (`M` the mesh's
      device count) takes `N / M` tokens, at most `max_tokens_per_rank`.
    topk_idx, topk_weights: optional routing shaped like `x` with `K` for `H` (else the router
      in `params` decides).
    routing: how the router picks experts (`Routing`).
    mode: "high_throughput" or "low_latency" (see `moe_mlp_per_shard`).

  Returns:
    `MoEOutput`: `out` shaped like `x`; `num_dropped`, `aux_loss`, `z_loss` `[M]` and
    `expert_counts` `[M, E]`, one entry per shard.
  """
  token_axes = _token_axes(group)
  num_shards = math.prod(group.mesh.shape[a] for a in token_axes)
  lead = x.shape[:-1]
  num_tokens = math.prod(lead)
  if x.ndim not in (2, 3):
    raise ValueError(f"jax_ep.moe_mlp: x must be [N, H] or [B, S, H], got shape {x.shape}")
  if num_tokens % num_shards:
    raise ValueError(f"jax_ep.moe_mlp: {num_tokens} tokens (x shape {x.shape}) must split "
                     f"evenly over the mesh's {num_shards} devices (axes {token_axes})")
  tokens = P(token_axes)
  x = group.constrain(x.reshape(num_tokens, x.shape[-1]), tokens)
  routing_args = ()
  if topk_idx is not None:
    if topk_weights is None:
      raise ValueError("jax_ep.moe_mlp: topk_weights must be given with topk_idx")
    k = topk_idx.shape[-1]
    routing_args = (group.constrain(topk_idx.reshape(num_tokens, k), tokens),
                    group.constrain(topk_weights.reshape(num_tokens, k), tokens))
  specs = param_specs(group.axis_name, params)
  params = MoEParams(*(None if p is None else group.constrain(p, s)
                       for p, s in zip(params, specs)))

  def body(params, x, *routing_args):
    result = moe_mlp_per_shard(group, params, x, *routing_args, routing=routing, mode=mode)
    return result._replace(num_dropped=result.num_dropped[None], aux_loss=result.aux_loss[None],
                           z_loss=result.z_loss[None],
                           expert_counts=result.expert_counts[None])

  in_specs = (specs, tokens) + (tokens,) * len(routing_args)
  out_specs = MoEOutput(tokens, tokens, tokens, tokens, tokens)
  result = jax.shard_map(body, mesh=group.mesh, in_specs=in_specs, out_specs=out_specs)(
      params, x, *routing_args)
  return result._replace(out=result.out.reshape(*lead, result.out.shape[-1]))
