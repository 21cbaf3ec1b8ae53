"""A whole MoE layer on dispatch/combine: router -> top-k -> dispatch -> experts
(`jax_ep.grouped_matmul`) -> combine, plus an optional shared expert, the auxiliary losses and
the per-expert counts.

`moe_mlp` takes global arrays (`[N, H]` or `[B, S, H]`, tokens split over every mesh axis,
experts over the group's) and enters `shard_map` itself; `moe_mlp_per_shard` is the body, for
models that are already inside a `shard_map`.

Precision follows Flax's `param_dtype` / `dtype` split: parameters are stored in any floating
dtype and cast to the group's dtype (the compute dtype, the one dispatch sends) inside the
layer; `x` is cast to it for dispatch and the output comes back in `x`'s own dtype; the router
runs in float32 on `x` as given.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ep import low_latency, ops, overlap
from jax_ep.backends.options import OWN_STREAM
from jax_ep.config import positive_int
from jax_ep.experts.fp8 import Fp8Weights, quantize_weights
from jax_ep.group import Group
from jax_ep.layer_checks import check_init_sizes, check_layer_shapes
from jax_ep.mlp import (GATED_ACTIVATIONS, check_activation, check_up, expert_mlp,
                        expert_mlp_slabs, shared_mlp)
from jax_ep.routing import (Routing, expert_counts, load_balancing_loss, route,  # noqa: F401
                            route_logits, router_z_loss, update_router_bias)

# How the load-balancing loss groups tokens: all of a shard's tokens at once, or each sequence
# of a `[B, S, H]` input on its own (Switch Transformer's and MaxText's form).
AUX_LOSS_SCOPES = ("per_shard", "per_sequence")
MODES = ("high_throughput", "low_latency")


class MoEParams(NamedTuple):
  """Weights of one MoE layer (global shapes; experts are sharded over the EP axis).

  Every weight may be stored in any floating dtype (float32 master weights, say): the layer
  casts the experts' and the shared expert's to the group's dtype, and runs the router in
  float32.

  Attributes:
    router: `[H, E]`, replicated.
    w_gate: `[E, H, F]`: the gate projection of the gated activations ("swiglu", "geglu"),
      the input projection of the plain ones ("gelu", "silu").
    w_up: `[E, H, F]` up projection of the gated activations; None for the plain ones.
    w_down: `[E, F, H]`.
    router_bias: optional `[E]` float32 selection bias (`Routing`; not trained by gradients:
      `update_router_bias` moves it), replicated.
    shared_gate, shared_up, shared_down: optional `[H, Fs]`, `[H, Fs]` (None for the plain
      activations), `[Fs, H]`: a dense expert with the routed experts' activation that every
      token goes through, added to their output, replicated.
  """
  router: jax.Array
  w_gate: jax.Array
  w_up: jax.Array | None
  w_down: jax.Array
  router_bias: jax.Array | None = None
  shared_gate: jax.Array | None = None
  shared_up: jax.Array | None = None
  shared_down: jax.Array | None = None


class MoEOutput(NamedTuple):
  """What the layer returns. From `moe_mlp`, the statistics carry a leading axis of the shards
  (`[M]`, `[M, E]`, one entry per shard of tokens): mean the losses and sum the counts over it.
  The per-token fields are shaped like the tokens (`x`'s shape without `H`). Read the fields by
  name: more may be appended.

  Attributes:
    out: the layer's output, shaped like its input, in its dtype.
    num_dropped: rows that did not fit the receive capacity (0 at the default capacity).
    aux_loss: the load-balancing loss (`load_balancing_loss`; 1 when balanced) of the shard's
      tokens ("per_shard"), or the mean of its sequences' losses ("per_sequence"; the mean over
      all sequences where sequences cross shards); multiply by your coefficient. 0 when the
      routing was given.
    z_loss: the router z-loss of the shard's tokens (`router_z_loss`); 0 when the routing was
      given.
    expert_counts: `[E]` int32 slots of the shard's tokens routed to each expert.
    router_probs: `[..., E]` float32 normalised router scores (`Routed.probs`: what the
      load-balancing loss weighs), differentiable; None when the routing was given.
    topk_idx: `[..., K]` int32 experts each token chose (or was given).
    topk_weights: `[..., K]` their weights: the router's in float32 (differentiable), or the
      given ones.
    num_invalid: int32 slots of the shard's given `topk_idx` outside `[-1, E)`, which route
      nowhere (as `dispatch` counts them); 0 when the router chose.
  """
  out: jax.Array
  num_dropped: jax.Array
  aux_loss: jax.Array
  z_loss: jax.Array
  expert_counts: jax.Array
  router_probs: jax.Array | None = None
  topk_idx: jax.Array | None = None
  topk_weights: jax.Array | None = None
  num_invalid: jax.Array | None = None


def init_moe_params(key, *, num_experts: int, hidden: int, ffn: int, dtype=jnp.bfloat16,
                    shared_ffn: int = 0, router_bias: bool = False,
                    activation: str = "swiglu") -> MoEParams:
  """Random weights: normal, scaled by the fan-in.

  Args:
    key: a `jax.random` key.
    num_experts, hidden, ffn: `E`, `H`, `F`.
    dtype: the experts' and the shared expert's storage dtype (the router is float32).
    shared_ffn: inner size `Fs` of a shared expert (0: none).
    router_bias: add a zero `[E]` float32 selection bias.
    activation: the experts' activation (`ACTIVATIONS`); the plain ones get no `w_up`.

  Returns:
    `MoEParams`.
  """
  check_activation("init_moe_params", activation)
  check_init_sizes(num_experts, hidden, ffn, shared_ffn, dtype)
  gated = activation in GATED_ACTIVATIONS
  k_router, k_gate, k_up, k_down, k_shared = jax.random.split(key, 5)
  scale_in, scale_out = hidden ** -0.5, ffn ** -0.5
  normal = jax.random.normal
  shared = {}
  if shared_ffn:
    ks = jax.random.split(k_shared, 3)
    shared = dict(
        shared_gate=(normal(ks[0], (hidden, shared_ffn)) * scale_in).astype(dtype),
        shared_up=((normal(ks[1], (hidden, shared_ffn)) * scale_in).astype(dtype)
                   if gated else None),
        shared_down=(normal(ks[2], (shared_ffn, hidden)) * shared_ffn ** -0.5).astype(dtype))
  return MoEParams(
      router=normal(k_router, (hidden, num_experts), jnp.float32) * scale_in,
      w_gate=(normal(k_gate, (num_experts, hidden, ffn)) * scale_in).astype(dtype),
      w_up=(normal(k_up, (num_experts, hidden, ffn)) * scale_in).astype(dtype) if gated else None,
      w_down=(normal(k_down, (num_experts, ffn, hidden)) * scale_out).astype(dtype),
      router_bias=jnp.zeros((num_experts,), jnp.float32) if router_bias else None, **shared)


def _check_options(fn: str, *, mode, activation, aux_loss_scope, remat, fp8=False) -> None:
  """Raises where the layer's static options are not ones it takes, naming `fn`."""
  if mode not in MODES:
    raise ValueError(f"jax_ep.{fn}: mode must be 'high_throughput' or 'low_latency', got "
                     f"{mode!r}")
  check_activation(fn, activation)
  if aux_loss_scope not in AUX_LOSS_SCOPES:
    raise ValueError(f"jax_ep.{fn}: aux_loss_scope must be 'per_shard' or 'per_sequence', got "
                     f"{aux_loss_scope!r}")
  if not isinstance(remat, bool):
    raise TypeError(f"jax_ep.{fn}: remat must be a bool, got {remat!r}")
  if not isinstance(fp8, bool):
    raise TypeError(f"jax_ep.{fn}: fp8 must be a bool, got {fp8!r}")
  if fp8 and mode == "low_latency":
    raise NotImplementedError(
        f"jax_ep.{fn}: fp8=True with mode='low_latency': the experts on the decode slabs run "
        f"bf16 (the low-latency dispatch's own row_format sends fp8 rows); use "
        f"mode='high_throughput' or fp8=False")
  if mode == "low_latency" and activation != "swiglu":
    raise NotImplementedError(
        f"jax_ep.{fn}: activation={activation!r} with mode='low_latency': the experts on the "
        f"decode slabs (expert_mlp_slabs) are SwiGLU only; use mode='high_throughput'")


def check_micro_batches(fn: str, micro_batches, mode: str) -> int:
  """`micro_batches` as a positive int, naming `fn`; the low-latency mode takes 1 only."""
  micro_batches = positive_int("micro_batches", micro_batches, f"jax_ep.{fn}")
  if micro_batches > 1 and mode == "low_latency":
    raise ValueError(f"jax_ep.{fn}: micro_batches={micro_batches} with mode='low_latency': the "
                     f"decode pair runs a step's few tokens in one call (to overlap it, use "
                     f"low_latency_dispatch_send / _wait); micro-batches split the "
                     f"high-throughput layer, mode='high_throughput'")
  return micro_batches


def check_micro_batch_tokens(fn: str, group: Group, micro_batches: int, num_tokens: int,
                             where: str) -> None:
  """Each shard's `num_tokens` (`where` says whose) must split into `micro_batches` equal
  micro-batches, each at most the group's `max_tokens_per_rank` (what one dispatch takes)."""
  if num_tokens % micro_batches:
    raise ValueError(f"jax_ep.{fn}: micro_batches={micro_batches} must divide each shard's "
                     f"token count, {num_tokens} ({where})")
  if micro_batches > 1 and num_tokens // micro_batches > group.max_tokens_per_rank:
    raise ValueError(f"jax_ep.{fn}: micro_batches={micro_batches} splits each shard's "
                     f"{num_tokens} tokens ({where}) into micro-batches of "
                     f"{num_tokens // micro_batches}, more than the group's "
                     f"max_tokens_per_rank={group.max_tokens_per_rank}")


_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def _check_layer(fn: str, params, x, *, mode, activation, aux_loss_scope, remat,
                 fp8=False) -> None:
  """Trace-time checks of the layer's arguments, with errors that name `fn`."""
  _check_options(fn, mode=mode, activation=activation, aux_loss_scope=aux_loss_scope,
                 remat=remat, fp8=fp8)
  if not isinstance(params, MoEParams):
    raise TypeError(f"jax_ep.{fn}: params must be a jax_ep.MoEParams, got "
                    f"{type(params).__name__}")
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"jax_ep.{fn}: x must be an array, got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"jax_ep.{fn}: x must have a floating-point dtype (it is cast to the "
                    f"group's dtype for dispatch), got {x.dtype}")
  for name, value in params._asdict().items():
    if isinstance(value, Fp8Weights):
      if name not in _EXPERT_WEIGHTS or not fp8:
        raise TypeError(f"jax_ep.{fn}: params.{name} is Fp8Weights (quantize_weights): "
                        + ("the experts' weights take them with fp8=True"
                           if name in _EXPERT_WEIGHTS else
                           "only the experts' weights (w_gate, w_up, w_down) may come "
                           "quantised"))
      continue
    if value is not None and not jnp.issubdtype(jnp.result_type(value), jnp.floating):
      raise TypeError(f"jax_ep.{fn}: params.{name} must have a floating-point dtype, got "
                      f"{jnp.result_type(value)}")
  for name in ("router", "w_gate", "w_down"):
    if getattr(params, name) is None:
      raise ValueError(f"jax_ep.{fn}: params.{name} is None")
  check_up(fn, "params.w_up", params.w_up, activation)
  if params.shared_gate is not None:
    check_up(fn, "params.shared_up", params.shared_up, activation)
  if aux_loss_scope == "per_sequence" and x.ndim != 3:
    raise ValueError(f"jax_ep.{fn}: aux_loss_scope='per_sequence' needs x as [B, S, H] "
                     f"sequences, got shape {x.shape}")


def _experts(group: Group, mode: str, activation: str, fp8: bool, weights, x, topk_idx,
             topk_weights):
  """dispatch -> experts -> combine, plus the shared expert, in the group's dtype:
  `(out [T, H], num_dropped, num_invalid)`. Under `remat` this is what the backward
  recomputes; the casts are inside so that only the inputs as stored are saved, not their
  compute-dtype copies. With `fp8` the expert weights come quantised (`Fp8Weights`)."""
  dtype = group.dtype
  w_gate, w_up, w_down, s_gate, s_up, s_down = (
      None if w is None else w if isinstance(w, Fp8Weights) else w.astype(dtype)
      for w in weights)
  x = x.astype(dtype)
  if mode == "low_latency":
    recv, handle = low_latency.low_latency_dispatch(group, x, topk_idx)
    y = expert_mlp_slabs(recv.x, w_gate, w_up, w_down, recv.count)
    out = low_latency.low_latency_combine(group, y, handle, topk_weights)
  else:
    recv, handle = ops.dispatch(group, x, topk_idx, topk_weights)
    y = expert_mlp(recv.x, w_gate, w_up, w_down, recv.group_sizes,
                   group_offsets=recv.group_offsets, activation=activation, fp8=fp8,
                   x_scales=recv.scales)
    out = ops.combine(group, y.astype(dtype), handle)
  if s_gate is not None:
    out = out + shared_mlp(x, s_gate, s_up, s_down, activation=activation)
  return out, recv.num_dropped, recv.num_invalid


def _micro_batched(experts, micro_batches: int, weights, x, topk_idx, topk_weights):
  """`experts` (`_experts`, under `remat` checkpointed) on `micro_batches` equal runs of
  consecutive tokens, each its own dispatch -> experts -> combine: `(out [T, H], num_dropped,
  num_invalid)`, the counts summed over them.

  NOTES: the micro-batches share only the weights and the routing computed before the split;
  each dispatch reads its own tokens and routing alone, so XLA sees independent chains and can
  run one micro-batch's communication beside another's experts, forward and backward. A static
  loop, not `lax.scan` / `fori_loop`, whose iterations XLA runs one after another. `lax.split`
  cuts the tokens (its transpose is one concatenate, where slices would transpose into a padded
  copy of the whole `[T, H]` per micro-batch, summed). Each call casts the weights itself (XLA
  merges the forward's identical casts), so their gradients are summed in the storage dtype.
  """
  sizes = [x.shape[0] // micro_batches] * micro_batches
  parts = zip(*(jax.lax.split(a, sizes) for a in (x, topk_idx, topk_weights)))
  outs, dropped, invalid = zip(*(experts(weights, *part) for part in parts))
  return (jnp.concatenate(outs), functools.reduce(jnp.add, dropped),
          functools.reduce(jnp.add, invalid))


def _pipelined(experts, micro_batches: int, weights, x, topk_idx, topk_weights):
  """`_micro_batched`, the micro-batches interleaved on jax_ep's own stream
  (`Group(comm_stream="jax_ep")`, jax_ep/overlap.py): each one's dispatch and combine run
  beside another's experts, in the forward and in the backward."""
  sizes = [x.shape[0] // micro_batches] * micro_batches
  xs, idxs, ws = (jax.lax.split(a, sizes) for a in (x, topk_idx, topk_weights))

  def one(weights, part, idx):
    x, w = part
    out, dropped, invalid = experts(weights, x, idx, w)
    return out, (dropped, invalid)

  outs, counts = overlap.pipeline(one, weights, list(zip(xs, ws)), idxs)
  dropped, invalid = zip(*counts)
  return (jnp.concatenate(outs), functools.reduce(jnp.add, dropped),
          functools.reduce(jnp.add, invalid))


def _spanning_sequence_loss(probs, topk_idx, seq_len: int, num_sequences: int, token_axes):
  """The per-sequence load-balancing loss when sequences cross shard boundaries: each
  sequence's slot counts and score sums, summed over the shards (`token_axes`, in the order
  `P(token_axes)` splits the tokens), then `load_balancing_loss`'s formula per sequence; the
  mean over all sequences, the same on every shard."""
  num_tokens, num_experts = probs.shape
  num_topk = topk_idx.shape[1]
  first = jax.lax.axis_index(token_axes) * num_tokens
  sequence = (first + jnp.arange(num_tokens, dtype=jnp.int32)) // seq_len
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  counts = jnp.zeros((num_sequences, num_experts), jnp.float32).at[
      jnp.broadcast_to(sequence[:, None], topk_idx.shape),
      jnp.where(valid, topk_idx, num_experts)].add(1.0, mode="drop")
  score_sums = jax.ops.segment_sum(probs, sequence, num_segments=num_sequences)
  counts, score_sums = jax.lax.psum((counts, score_sums), token_axes)
  fraction = counts / (seq_len * num_topk)
  losses = num_experts * jnp.sum(fraction * (score_sums / seq_len), axis=-1)
  return jnp.mean(losses)


def _forward(group: Group, params: MoEParams, x, topk_idx=None, topk_weights=None, *, routing,
             mode, activation, aux_loss_scope, remat, micro_batches=1, seq_len=None,
             spanning=None, fp8=False) -> MoEOutput:
  """The layer on this shard's tokens `x` `[T, H]` (checked by the caller); per-token fields
  `[T, ...]`. `spanning`: `(num_sequences, token_axes)` when sequences of `seq_len` tokens
  cross this shard's boundaries. The routing, its losses and counts are of all `T` tokens;
  `micro_batches` splits only what follows it."""
  aux = z = jnp.zeros((), jnp.float32)
  probs = None
  if topk_idx is None:
    logits = x.astype(jnp.float32) @ params.router.astype(jnp.float32)
    routed = route_logits(logits, group.num_topk, routing, params.router_bias)
    topk_idx, topk_weights, probs = routed.topk_idx, routed.topk_weights, routed.probs
    if aux_loss_scope == "per_shard":
      aux = load_balancing_loss(probs, topk_idx)
    elif spanning is None:
      aux = load_balancing_loss(probs.reshape(-1, seq_len, probs.shape[-1]),
                                topk_idx.reshape(-1, seq_len, topk_idx.shape[-1]))
    else:
      aux = _spanning_sequence_loss(probs, topk_idx, seq_len, *spanning)
    z = router_z_loss(routed.logits)
  experts = functools.partial(_experts, group, mode, activation, fp8)
  if remat:
    # Saves only the layer's input, the routing and the weights as stored: the backward runs
    # dispatch, the experts and combine again (one more round of communication) instead of
    # keeping the dispatched rows and the experts' hidden activations. With micro-batches each
    # is its own checkpoint, so the backward holds one micro-batch's recomputed activations at
    # a time (more while XLA overlaps them).
    experts = jax.checkpoint(experts)
  weights = (params.w_gate, params.w_up, params.w_down, params.shared_gate, params.shared_up,
             params.shared_down)
  if fp8:
    # Once per call, from the masters as stored (unless they come quantised already, e.g. once
    # per step for several calls): every micro-batch (and, under remat, the recomputation)
    # multiplies the same e4m3 blocks, and their gradients sum into one.
    weights = tuple(w if w is None or isinstance(w, Fp8Weights) else quantize_weights(w)
                    for w in weights[:3]) + weights[3:]
  if micro_batches == 1:
    out, num_dropped, num_invalid = experts(weights, x, topk_idx, topk_weights)
  else:
    split = _pipelined if group.options.comm_stream == OWN_STREAM else _micro_batched
    out, num_dropped, num_invalid = split(experts, micro_batches, weights, x, topk_idx,
                                          topk_weights)
  return MoEOutput(out.astype(x.dtype), num_dropped, aux, z,
                   expert_counts(topk_idx, group.num_experts), probs, topk_idx, topk_weights,
                   num_invalid)


def moe_mlp_per_shard(group: Group, params: MoEParams, x, topk_idx=None, topk_weights=None,
                      *, routing: Routing = Routing(), mode: str = "high_throughput",
                      activation: str = "swiglu", aux_loss_scope: str = "per_shard",
                      remat: bool = False, micro_batches: int = 1,
                      fp8: bool = False) -> MoEOutput:
  """The layer body, inside `shard_map` over the group's axis.

  Args:
    group: the `Group`.
    params: this shard's `MoEParams` (router, bias and shared expert replicated; expert
      weights `[L, ...]`), in any floating dtype (cast to the group's inside).
    x: `[T, H]` this shard's tokens, or `[b, S, H]` whole sequences; any floating dtype (cast
      to the group's for dispatch; the output comes back in it).
    topk_idx, topk_weights: optional routing shaped like `x` with `K` for `H` (weights
      float32, or bf16 / f16, cast to float32); the router in `params` decides when they are
      omitted (the losses are then its, else zero).
    routing: how the router picks experts (`Routing`).
    mode: "high_throughput" (`dispatch` / `combine`, experts on expert-grouped rows) or
      "low_latency" (the decode pair, experts on the `[L, R*T_max, H]` slabs, SwiGLU only; the
      group needs `low_latency=True` on the cuda backend).
    activation: the experts' (and shared expert's) activation, one of `ACTIVATIONS`:
      "swiglu", "geglu" (gated, with `w_up`), "gelu", "silu" (two matrices, `w_up` None).
    aux_loss_scope: "per_shard" (the load-balancing loss over all the shard's tokens) or
      "per_sequence" (per sequence of `[b, S, H]` `x`, then averaged).
    remat: recompute the dispatch, the experts and the combine in the backward instead of
      saving their activations (`jax.checkpoint`): only the layer's input and the routing
      are kept.
    micro_batches: split the shard's tokens into this many equal runs of consecutive tokens,
      each with its own dispatch -> experts -> combine, so that one micro-batch's
      communication can run beside another's experts (`moe_mlp`'s `micro_batches`); it must
      divide `T` (`b * S` for sequences). "high_throughput" mode only.
    fp8: the experts in FP8 (`moe_mlp`'s `fp8`).

  Returns:
    `MoEOutput` with scalars and `[E]` counts for this shard.
  """
  _check_layer("moe_mlp_per_shard", params, x, mode=mode, activation=activation,
               aux_loss_scope=aux_loss_scope, remat=remat, fp8=fp8)
  micro_batches = check_micro_batches("moe_mlp_per_shard", micro_batches, mode)
  if x.ndim not in (2, 3):
    raise ValueError(f"jax_ep.moe_mlp_per_shard: x must be [T, H] or [b, S, H], got shape "
                     f"{x.shape}")
  check_layer_shapes("moe_mlp_per_shard", group, params, x, topk_idx, topk_weights, per_shard=True,
                     fp8=fp8)
  check_micro_batch_tokens("moe_mlp_per_shard", group, micro_batches, math.prod(x.shape[:-1]),
                           f"x shape {x.shape}")
  lead, hidden = x.shape[:-1], x.shape[-1]
  flat = lambda a: None if a is None else a.reshape(-1, a.shape[-1])  # noqa: E731
  result = _forward(group, params, flat(x), flat(topk_idx), flat(topk_weights), routing=routing,
                    mode=mode, activation=activation, aux_loss_scope=aux_loss_scope,
                    remat=remat, micro_batches=micro_batches,
                    seq_len=x.shape[1] if x.ndim == 3 else None, fp8=fp8)
  shaped = lambda a: None if a is None else a.reshape(*lead, a.shape[-1])  # noqa: E731
  return result._replace(out=result.out.reshape(*lead, hidden),
                         router_probs=shaped(result.router_probs),
                         topk_idx=shaped(result.topk_idx),
                         topk_weights=shaped(result.topk_weights))


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


def _unflatten(group: Group, value, lead, token_axes):
  """`[N, C]` split over `token_axes` -> `[*lead, C]`. On Explicit mesh axes a batch of `B`
  sequences that the shards do not divide has no sharding the split implies: the major token
  axes whose sizes divide `B` split it and the rest split `S` where they divide it (rows move
  only where the shards cut the sequences elsewhere)."""
  from jax.sharding import AxisType, NamedSharding
  if value is None:
    return None
  shape = (*lead, value.shape[-1])
  sizes = [group.mesh.shape[a] for a in token_axes]
  explicit = all(t == AxisType.Explicit for t in group.mesh.axis_types)
  if len(lead) == 1 or lead[0] % math.prod(sizes) == 0 or not explicit:
    return value.reshape(shape)
  split = 0
  while split < len(sizes) and lead[0] % math.prod(sizes[:split + 1]) == 0:
    split += 1
  rest = token_axes[split:] if lead[1] % math.prod(sizes[split:]) == 0 else ()
  spec = P(token_axes[:split] or None, rest or None, None)
  return jax.lax.reshape(value, shape, out_sharding=NamedSharding(group.mesh, spec))


def moe_mlp(group: Group, params: MoEParams, x, topk_idx=None, topk_weights=None, *,
            routing: Routing = Routing(), mode: str = "high_throughput",
            activation: str = "swiglu", aux_loss_scope: str = "per_shard",
            remat: bool = False, micro_batches: int = 1, fp8: bool = False) -> MoEOutput:
  """The whole layer on global arrays; enters `shard_map` over the group's mesh.

  Args:
    group: the `Group`.
    params: global `MoEParams` (`E` experts), in any floating dtype: the experts' and the
      shared expert's weights are cast to the group's dtype inside the layer (their gradients
      come back in their own dtype), the router runs in float32.
    x: `[N, H]` or `[B, S, H]` tokens, any floating dtype (cast to the group's for dispatch;
      the output comes back in `x`'s). They are split evenly over every axis of the group's
      mesh (the EP axis and, beside it, data axes): each of the `M` shards (`M` the mesh's
      device count) takes `N / M` tokens, at most `max_tokens_per_rank`.
    topk_idx, topk_weights: optional routing shaped like `x` with `K` for `H` (else the router
      in `params` decides).
    routing: how the router picks experts (`Routing`).
    mode: "high_throughput" or "low_latency" (see `moe_mlp_per_shard`).
    activation: "swiglu" (default), "geglu", "gelu" or "silu" (see `moe_mlp_per_shard`).
    aux_loss_scope: "per_shard" (default: the load-balancing loss of each shard's tokens) or
      "per_sequence" (`[B, S, H]` `x` only: the loss of each sequence, averaged, wherever the
      shards cut the sequences; Switch Transformer's and MaxText's form).
    remat: recompute dispatch, experts and combine in the backward (`jax.checkpoint`), keeping
      only the layer's input and the routing.
    micro_batches: a positive int dividing each shard's token count `N / M` (default 1: one
      dispatch and one combine per layer). The router runs once on all of a shard's tokens
      (so the losses, counts and router outputs are the unsplit layer's); then its tokens and
      their routing are split into this many equal runs of consecutive tokens, each with its
      own dispatch -> experts -> combine, on the same group. No micro-batch's dispatch depends
      on another's results, so one micro-batch's communication can run beside another's
      experts (in the forward and in the backward) where the group's ops have a stream of
      their own (cuda backend: `jax_ep.Group(..., comm_stream="jax_ep")`, whose pipeline
      interleaves the micro-batches, or `comm_stream=1`); on XLA's compute stream (the
      default) they wait in line with the GEMMs. Results equal the unsplit layer's
      within rounding; `num_dropped` is the sum over the micro-batches. Each micro-batch is
      one call of the group: at most `max_tokens_per_rank` tokens (`N / M / micro_batches`; a
      group sized for a micro-batch serves the whole shard), and the group's whole `capacity`
      for its rows, which the backward keeps once per micro-batch (`jax_ep.memory_bytes`).
      With a `capacity` or `buffer_factor` sized for the whole shard, a micro-batch has that
      many rows for fewer tokens and the split drops at most what the unsplit layer would.
      "high_throughput" mode only.
    fp8: the experts in FP8, DeepSeek-V3's recipe (`jax_ep.expert_mlp`'s `fp8`): the expert
      weights quantised once per call from the masters in `params` (128 x 128 blocks; or
      given as `Fp8Weights`, `jax_ep.quantize_weights` of the masters once per step for
      several calls, their gradients passing straight through to the masters), the
      dispatched rows per token per 128 channels (by the dispatch itself when the group's
      `wire_format` is an fp8 `RowFormat`, else after it), the forward and input-gradient
      products in FP8, the weight gradients in FP8 (bf16 with
      `jax_ep.experts.override(fp8_weight_grad=False)`), combine in the group's dtype; gradients
      for the masters, the router and `x` as without it. Off by default; H and the experts' F
      must be multiples of 128; "high_throughput" mode only. The router and the shared
      expert stay in their precision.

  Returns:
    `MoEOutput`: `out` shaped like `x`; `num_dropped`, `aux_loss`, `z_loss`, `num_invalid`
    `[M]` and `expert_counts` `[M, E]`, one entry per shard (mean `aux_loss` over them for the
    layer's loss in either scope); `router_probs` `[..., E]`, `topk_idx` and `topk_weights`
    `[..., K]` shaped like the tokens.
  """
  _check_layer("moe_mlp", params, x, mode=mode, activation=activation,
               aux_loss_scope=aux_loss_scope, remat=remat, fp8=fp8)
  micro_batches = check_micro_batches("moe_mlp", micro_batches, mode)
  token_axes = _token_axes(group)
  num_shards = math.prod(group.mesh.shape[a] for a in token_axes)
  lead = x.shape[:-1]
  num_tokens = math.prod(lead)
  if x.ndim not in (2, 3):
    raise ValueError(f"jax_ep.moe_mlp: x must be [N, H] or [B, S, H], got shape {x.shape}")
  check_layer_shapes("moe_mlp", group, params, x, topk_idx, topk_weights, per_shard=False,
                     fp8=fp8)
  if num_tokens % num_shards:
    raise ValueError(f"jax_ep.moe_mlp: {num_tokens} tokens (x shape {x.shape}) must split "
                     f"evenly over the mesh's {num_shards} devices (axes {token_axes})")
  check_micro_batch_tokens("moe_mlp", group, micro_batches, num_tokens // num_shards,
                           f"x shape {x.shape} over the mesh's {num_shards} devices")
  seq_len = spanning = None
  if aux_loss_scope == "per_sequence":
    seq_len = x.shape[1]
    if (num_tokens // num_shards) % seq_len:
      spanning = (lead[0], token_axes)
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
    result = _forward(group, params, x, *routing_args, routing=routing, mode=mode,
                      activation=activation, aux_loss_scope=aux_loss_scope, remat=remat,
                      micro_batches=micro_batches, seq_len=seq_len, spanning=spanning,
                      fp8=fp8)
    return result._replace(num_dropped=result.num_dropped[None], aux_loss=result.aux_loss[None],
                           z_loss=result.z_loss[None],
                           expert_counts=result.expert_counts[None],
                           num_invalid=result.num_invalid[None])

  in_specs = (specs, tokens) + (tokens,) * len(routing_args)
  out_specs = MoEOutput(*(tokens,) * len(MoEOutput._fields))
  if routing_args:  # no router ran: no probabilities to return
    out_specs = out_specs._replace(router_probs=None)
  result = jax.shard_map(body, mesh=group.mesh, in_specs=in_specs, out_specs=out_specs)(
      params, x, *routing_args)
  shaped = lambda a: _unflatten(group, a, lead, token_axes)  # noqa: E731
  return result._replace(out=shaped(result.out), router_probs=shaped(result.router_probs),
                         topk_idx=shaped(result.topk_idx),
                         topk_weights=shaped(result.topk_weights))
