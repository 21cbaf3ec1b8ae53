"""Routers of MoE layers: scores -> top-k experts and weights, the auxiliary losses, the
statistics a training loop watches, auxiliary-loss-free balancing, and the merge of a token's
slots that name one expert (`merge_duplicate_slots`, which every dispatch applies).

Per-token functions of the router's logits; they run anywhere (inside `shard_map` on a rank's
tokens, or on all tokens at once).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep.config import positive_int


@dataclasses.dataclass(frozen=True)
class Routing:
  """How tokens choose their experts (static, hashable).

  Attributes:
    score: 'softmax' (a distribution over all experts: Mixtral, Qwen3, Switch) or 'sigmoid'
      (an independent gate per expert: DeepSeek-V3).
    renormalize: rescale the chosen experts' scores to sum to one.
    num_groups: group-limited selection (DeepSeek-V3): the experts form `num_groups` equal
      groups of consecutive ids; a token first keeps the `topk_groups` groups whose two best
      selection scores sum highest, then picks its experts among them. 1: every expert.
    topk_groups: the groups a token keeps (with `num_groups`).
    routed_scaling_factor: multiplies the final weights.
  The per-expert selection bias (`route(..., bias=)`) is added to the scores for choosing the
  experts only; the weights are the unbiased scores.
  """
  score: str = "softmax"
  renormalize: bool = True
  num_groups: int = 1
  topk_groups: int = 1
  routed_scaling_factor: float = 1.0

  def __post_init__(self):
    if self.score not in ("softmax", "sigmoid"):
      raise ValueError(f"jax_ep.Routing: score must be 'softmax' or 'sigmoid', got "
                       f"{self.score!r}")
    if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
      raise ValueError(f"jax_ep.Routing: need 1 <= topk_groups <= num_groups, got "
                       f"topk_groups={self.topk_groups}, num_groups={self.num_groups}")

  def check(self, num_experts: int, num_topk: int) -> None:
    """Raises a ValueError where this routing cannot pick `num_topk` of `num_experts`."""
    if num_experts % self.num_groups:
      raise ValueError(f"jax_ep.Routing: num_groups={self.num_groups} must divide "
                       f"num_experts={num_experts}")
    per_group = num_experts // self.num_groups
    if self.num_groups > 1 and per_group < 2:
      raise ValueError(f"jax_ep.Routing: group-limited routing scores a group by its two best "
                       f"experts; num_experts / num_groups = {per_group}")
    if num_topk > self.topk_groups * per_group:
      raise ValueError(f"jax_ep.Routing: num_topk={num_topk} is more than the "
                       f"{self.topk_groups} kept groups of {per_group} experts hold")


class Routed(NamedTuple):
  """What a router decided for `T` tokens.

  Attributes:
    topk_idx: `[T, K]` int32 expert ids.
    topk_weights: `[T, K]` float32 weights.
    logits: `[T, E]` float32 router logits.
    probs: `[T, E]` float32 scores normalised per token (softmax, or sigmoid gates over their
      sum): what the load-balancing loss weighs.
  """
  topk_idx: jax.Array
  topk_weights: jax.Array
  logits: jax.Array
  probs: jax.Array


def route_logits(logits, num_topk: int, routing: Routing = Routing(), bias=None) -> Routed:
  """Top-k experts and weights of `[T, E]` logits (see `Routing`); `bias` `[E]` is added to the
  scores for selection only and gets no gradient."""
  logits = logits.astype(jnp.float32)
  num_experts = logits.shape[-1]
  routing.check(num_experts, num_topk)
  if routing.score == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    probs = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.maximum(jnp.sum(scores, axis=-1, keepdims=True), 1e-20)
  select = scores
  if bias is not None:
    select = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
  select = jax.lax.stop_gradient(select)
  if routing.num_groups > 1:
    tokens = logits.shape[:-1]
    grouped = select.reshape(*tokens, routing.num_groups, num_experts // routing.num_groups)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
    _, kept = jax.lax.top_k(group_score, routing.topk_groups)
    keep = jnp.any(jnp.arange(routing.num_groups) == kept[..., None], axis=-2)  # [T, G]
    keep = jnp.repeat(keep, num_experts // routing.num_groups, axis=-1)
    select = jnp.where(keep, select, -jnp.inf)
  _, topk_idx = jax.lax.top_k(select, num_topk)
  weights = jnp.take_along_axis(scores, topk_idx, axis=-1)
  if routing.renormalize:  # (gates that all underflowed give zeros, not NaN)
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)
  weights = weights * routing.routed_scaling_factor
  return Routed(topk_idx.astype(jnp.int32), weights.astype(jnp.float32), logits, probs)


def _check_route(x, router, num_topk, bias) -> None:
  """`route`'s arguments, each named with its shape and what it must be."""
  for name, value in (("x", x), ("router", router)):
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
      raise TypeError(f"jax_ep.route: {name} must be an array, got {type(value).__name__}")
  if router.ndim != 2:
    raise ValueError(f"jax_ep.route: router must have shape [H, E], got shape {router.shape}")
  hidden, num_experts = router.shape
  if x.ndim < 1 or x.shape[-1] != hidden:
    raise ValueError(f"jax_ep.route: x must be [T, H] with the router's H = {hidden} (router "
                     f"shape {router.shape}), got shape {x.shape}")
  positive_int("num_topk", num_topk, "jax_ep.route")
  if num_topk > num_experts:
    raise ValueError(f"jax_ep.route: num_topk={num_topk} must be <= the router's "
                     f"E = {num_experts} experts (router shape {router.shape})")
  if bias is not None and getattr(bias, "shape", None) != (num_experts,):
    raise ValueError(f"jax_ep.route: bias must have shape [E] = ({num_experts},) (router shape "
                     f"{router.shape}), got {getattr(bias, 'shape', type(bias).__name__)}")


def route(x, router, num_topk: int, routing: Routing = Routing(), bias=None):
  """`(topk_idx [T, K] int32, topk_weights [T, K] float32)` of tokens `x [T, H]` under a
  router `[H, E]` (float32 logits `x @ router`).

  Raises a `ValueError` / `TypeError` naming `x`, `router`, `num_topk` or `bias` where their
  shapes do not agree."""
  _check_route(x, router, num_topk, bias)
  routed = route_logits(x.astype(jnp.float32) @ router.astype(jnp.float32), num_topk, routing,
                        bias)
  return routed.topk_idx, routed.topk_weights


def expert_counts(topk_idx, num_experts: int):
  """`[E]` int32: slots routed to each expert (ids outside `[0, E)` not counted)."""
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  return jnp.bincount(jnp.where(valid, topk_idx, num_experts).reshape(-1),
                      length=num_experts + 1)[:num_experts].astype(jnp.int32)


def expert_capacity(sequence_length: int, num_topk: int, num_experts: int,
                    capacity_factor: float) -> int:
  """Slots each expert takes from one sequence under `limit_expert_capacity`:
  `int(max(ceil(S * K / E) * f, f))`, MaxText's (and GShard's) per-expert capacity."""
  return int(max(math.ceil(sequence_length * num_topk / num_experts) * capacity_factor,
                 capacity_factor))


def limit_expert_capacity(topk_idx, num_experts: int, capacity_factor: float, *,
                          sequence_length: int | None = None):
  """Drops the slots past each expert's capacity per sequence, as MaxText's and GShard's
  `capacity_factor` does: a model ported from them routes the same slots with it.

  Each sequence of `S` tokens gives each expert at most `C = expert_capacity(S, K, E, f)`
  slots, taken in token order and, within a token, in slot order (slot `(s, k)` is kept when
  fewer than `C` earlier slots of its sequence name its expert). A token's slots that name one
  expert count once each, as there. This is not what `jax_ep.Group(buffer_factor=f)` does:
  that sizes a rank's receive buffer for all of its experts together and drops only what does
  not fit it, so at the same `f` it drops fewer slots (none, while no rank receives more than
  `f` times a balanced share). Call it on the router's output before `dispatch` (or pass its
  ids to `moe_mlp`); dropped slots become -1, which dispatch sends nowhere and combine weighs
  zero, as MaxText's zeroed combine weights do.

  Args:
    topk_idx: `[T, K]` int32 expert ids (`T` tokens of this rank, whole sequences of
      `sequence_length` tokens each, in order). Ids outside `[0, E)` are kept and not counted.
    num_experts: `E`.
    capacity_factor: `f`, positive.
    sequence_length: `S`, dividing `T`; default `T` (all the tokens are one sequence).

  Returns:
    `(topk_idx, num_dropped)`: the ids with dropped slots set to -1, and the `[]` int32 count
    of slots dropped.
  """
  where = "jax_ep.limit_expert_capacity"
  if not hasattr(topk_idx, "shape") or len(topk_idx.shape) != 2:
    raise ValueError(f"{where}: topk_idx must be [T, K], got "
                     f"{getattr(topk_idx, 'shape', type(topk_idx).__name__)}")
  num_experts = positive_int("num_experts", num_experts, where)
  if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
      or not math.isfinite(capacity_factor) or capacity_factor <= 0):
    raise ValueError(f"{where}: capacity_factor must be a positive finite number, got "
                     f"{capacity_factor!r}")
  num_tokens, num_topk = topk_idx.shape
  if sequence_length is None:
    sequence_length = num_tokens
  sequence_length = positive_int("sequence_length", sequence_length, where) if num_tokens else 1
  if num_tokens % sequence_length:
    raise ValueError(f"{where}: sequence_length={sequence_length} must divide the "
                     f"{num_tokens} tokens of topk_idx (shape {topk_idx.shape})")
  if num_tokens == 0:
    return topk_idx, jnp.zeros((), jnp.int32)
  capacity = expert_capacity(sequence_length, num_topk, num_experts, capacity_factor)
  ids = topk_idx.reshape(num_tokens // sequence_length, sequence_length * num_topk)
  valid = (ids >= 0) & (ids < num_experts)
  one_hot = (ids[..., None] == jnp.arange(num_experts, dtype=ids.dtype)) & valid[..., None]
  # The slot's 1-based place among its sequence's slots to its expert, in (token, slot) order.
  place = jnp.sum(jnp.cumsum(one_hot.astype(jnp.int32), axis=1) * one_hot, axis=-1)
  dropped = valid & (place > capacity)
  limited = jnp.where(dropped, -1, ids).reshape(topk_idx.shape).astype(topk_idx.dtype)
  return limited, jnp.sum(dropped).astype(jnp.int32)


def load_balancing_loss(probs, topk_idx):
  """Switch / GShard auxiliary loss `E * sum_e f_e * p_e`: `f_e` the fraction of the `T * K`
  slots routed to expert e, `p_e` its mean normalised score. 1 when balanced; differentiable
  through `probs`.

  Args:
    probs: `[T, E]` float32 normalised router scores (`Routed.probs`) of one group of `T`
      tokens, or `[..., S, E]`: then each sequence of `S` tokens is its own group and the
      result is the mean of their losses (the per-sequence form of Switch and MaxText).
    topk_idx: `[T, K]` (or `[..., S, K]`) int32 expert ids; ids outside `[0, E)` count in the
      slots but route nowhere.

  Returns:
    A float32 scalar.
  """
  if probs.ndim < 2 or probs.shape[:-1] != topk_idx.shape[:-1]:
    raise ValueError(f"jax_ep.load_balancing_loss: probs [..., T, E] and topk_idx [..., T, K] "
                     f"must agree on their token axes, got shapes {probs.shape} and "
                     f"{topk_idx.shape}")
  if probs.ndim > 2:
    probs = probs.reshape(-1, *probs.shape[-2:])
    topk_idx = topk_idx.reshape(-1, *topk_idx.shape[-2:])
    losses = jax.vmap(load_balancing_loss)(probs, topk_idx)
    return jnp.sum(losses) / max(losses.shape[0], 1)
  num_tokens, num_experts = probs.shape
  num_slots = max(num_tokens * topk_idx.shape[-1], 1)
  fraction = expert_counts(topk_idx, num_experts).astype(jnp.float32) / num_slots
  mean_prob = jnp.sum(probs.astype(jnp.float32), axis=0) / max(num_tokens, 1)
  return num_experts * jnp.sum(fraction * mean_prob)


def router_z_loss(logits):
  """ST-MoE's router z-loss: the mean over tokens of `logsumexp(logits)^2`."""
  if logits.shape[0] == 0:
    return jnp.zeros((), jnp.float32)
  return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)


def update_router_bias(bias, counts, rate: float = 1e-3):
  """DeepSeek-V3's auxiliary-loss-free balancing: each expert's selection bias moves by `rate`
  towards balance (down when it got more than the mean count, up when fewer).

  Args:
    bias: `[E]` float32 selection bias (`route(..., bias=)`).
    counts: `[E]` (or `[..., E]`, summed) slots routed to each expert, e.g. `expert_counts`.
    rate: the step.
  """
  counts = jnp.asarray(counts, jnp.float32)
  counts = counts.reshape(-1, counts.shape[-1]).sum(axis=0)
  return bias + rate * jnp.sign(jnp.mean(counts) - counts)


def merge_duplicate_slots(topk_idx, topk_weights, num_experts: int):
  """Slots of one token that name the same expert, merged into the first of them.

  Returns `(topk_idx, topk_weights)` where every later duplicate slot is -1 and the first slot
  of each expert carries the sum of the weights of the token's slots that name it. Ids outside
  `[0, E)` are left as they are (the backends count and ignore them). Differentiable in
  `topk_weights`: a merged slot's weight gradient is the gradient of the one row they share.
  With it a token brings at most `min(K, L)` rows to a rank, so the default capacity is the
  exact worst case.
  """
  num_topk = topk_idx.shape[-1]
  slots = jnp.arange(num_topk, dtype=jnp.int32)
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  # same[..., k, j]: slot j names slot k's expert (k valid). Two plain reductions over j
  # ("an earlier slot names it", "the weights of every slot naming it"): a search for the first
  # slot (argmax) would be a variadic reduction, which XLA emits as a kernel of its own, and an
  # einsum over a one-hot matrix a batched matrix product; these fuse with the comparisons.
  same = (topk_idx[..., :, None] == topk_idx[..., None, :]) & valid[..., :, None]
  duplicate = jnp.any(same & (slots[None, :] < slots[:, None]), axis=-1)
  merged_idx = jnp.where(duplicate, -1, topk_idx)
  summed = jnp.sum(jnp.where(same, topk_weights[..., None, :], 0.0), axis=-1)
  merged_w = jnp.where(duplicate, 0.0, jnp.where(valid, summed, topk_weights))
  return merged_idx, merged_w.astype(topk_weights.dtype)
