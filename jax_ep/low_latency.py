"""Public ops: the low-latency pair for decode, `low_latency_dispatch` / `low_latency_combine`,
and their send / wait halves.

Per-shard functions, as jax_ep/ops.py's (whose argument checks and handle origins they share):
call them inside `jax.shard_map` over the group's axis.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.backends import primitives
from jax_ep.config import RowFormat, as_row_format, check_fp8_hidden
from jax_ep.group import Group
from jax_ep.ops import (HandleOrigin, _check_array, _check_group, _check_origin, _check_tokens,
                        _origin, _strict_check)
from jax_ep.routing import merge_duplicate_slots


class LowLatencyResult(NamedTuple):
  """What a rank receives from `low_latency_dispatch`.

  Attributes:
    x: `[L, R*T_max, H]` (activation dtype, or float8_e4m3fn with an fp8 `RowFormat`); rows of
      expert l packed at the front of slab l, ordered by (source rank, source token); one row
      per (token, expert). Rows past `count[l]`: zeros on the reference backend, unspecified on
      the cuda backend (never read by `low_latency_combine`).
    scales: `[L, R*T_max, H/128]` float32 dequantisation scales with an fp8 `RowFormat` (UE8M0
      packed `[L, R*T_max, H/512]` int32 with `RowFormat.FP8_UE8M0`), else None.
    count: `[L]` int32 valid rows per local expert (the per-expert load of this call; sum it
      over calls to monitor balance).
    num_dropped: `[]` int32 rows that did not fit a slab: always 0 (a source brings at most
      `T <= T_max` rows to each expert once duplicate slots are merged); kept so that code
      written for `dispatch` reads the same field.
    num_invalid: `[]` int32 slots of this rank's `topk_idx` outside `[-1, E)`.
  """
  x: jax.Array
  scales: jax.Array | None
  count: jax.Array
  num_dropped: jax.Array
  num_invalid: jax.Array


class LowLatencyHandle(NamedTuple):
  """What `low_latency_combine` reuses from `low_latency_dispatch` (a pytree of arrays).

  Attributes:
    layout: backend-specific integer metadata: where dispatch put each row.
    topk_idx: `[T, K]` the ids given to dispatch (combine merges the weights of slots that name
      one expert, as dispatch merged their rows).
    origin: the group dispatch ran on (`HandleOrigin`, no arrays); the low-latency combines
      refuse the handle on any other group.
  """
  layout: Any
  topk_idx: jax.Array
  origin: HandleOrigin | None = None


def _row_format(group: Group, op: str, row_format) -> RowFormat:
  """The dispatch's `RowFormat` (a member, or its value or name as a string; None: PLAIN),
  checked against the group's hidden."""
  fmt = RowFormat.PLAIN if row_format is None else as_row_format(row_format, f"jax_ep.{op}")
  check_fp8_hidden(fmt, group.hidden, f"jax_ep.{op}", "row_format")
  return fmt


def _merged_ids(group: Group, topk_idx):
  """topk_idx with every later slot of a token that names the same expert set to -1."""
  return merge_duplicate_slots(topk_idx, jnp.zeros(topk_idx.shape, jnp.float32),
                               group.num_experts)[0]


def _low_latency_outputs(group: Group, topk_idx, outs):
  recv_x, scales, count, num_dropped, num_invalid, layout = outs
  num_dropped = _strict_check(group, num_dropped)
  return (LowLatencyResult(recv_x, scales, count, num_dropped, num_invalid),
          LowLatencyHandle(layout, topk_idx, _origin(group)))


def low_latency_dispatch(group: Group, x, topk_idx, *, row_format: RowFormat | None = None):
  """Decode-time dispatch: every receiver keeps a slab of `R*T_max` rows per local expert.

  Slots of one token that name the same expert are one row (as in `dispatch`), so a source
  brings at most `T` rows to a slab and nothing is ever dropped. On the cuda backend the group
  must be created with `low_latency=True`; rows of a slab past `count` are then left
  unspecified (the reference writes zeros): mask them before anything that mixes rows.

  Args:
    group: the `Group`. x: `[T, H]`. topk_idx: `[T, K]` int32 (as in `dispatch`).
    row_format: how the rows travel and arrive (`jax_ep.RowFormat`; default PLAIN, the
      activations' dtype): FP8 (float8_e4m3fn rows with one float32 scale per 128 channels,
      H % 128 == 0), FP8_POW2_SCALES (those scales rounded up to powers of two), FP8_UE8M0
      (those scales as UE8M0 exponents, four per int32: `scales` `[L, R*T_max, H/512]` int32,
      H % 512 == 0). A member's value or name as a string is taken too.

  Returns:
    `(LowLatencyResult, LowLatencyHandle)`.
  """
  _check_group(group, "low_latency_dispatch")
  _check_tokens(group, "low_latency_dispatch", x, topk_idx)
  fmt = _row_format(group, "low_latency_dispatch", row_format)
  outs = primitives.low_latency_dispatch(group.backend, x, _merged_ids(group, topk_idx), fmt)
  return _low_latency_outputs(group, topk_idx, outs)


class LowLatencySent:
  """What `low_latency_dispatch_send` / `low_latency_combine_send` return: the operation in
  flight, to pass to the matching wait (a pytree; arrays only, the options are static)."""

  def __init__(self, op: str, arrays, static):
    self.op, self.arrays, self.static = op, arrays, static

  def tree_flatten(self):
    return (self.arrays,), (self.op, self.static)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(aux[0], children[0], aux[1])


jax.tree_util.register_pytree_node_class(LowLatencySent)


def low_latency_dispatch_send(group: Group, x, topk_idx, *,
                              row_format: RowFormat | None = None):
  """The send half of `low_latency_dispatch` (same arguments): the rows leave at once; work
  placed between this and `low_latency_dispatch_wait` (which returns what
  `low_latency_dispatch` returns) can run while they travel.

  One send of each op may be outstanding per group: issue send, wait, send, wait; a second
  send before the wait fails the group (`TimeoutError` naming the op). Not differentiable and
  not batched by `vmap` (use `low_latency_dispatch` there).
  """
  _check_group(group, "low_latency_dispatch_send")
  _check_tokens(group, "low_latency_dispatch_send", x, topk_idx)
  fmt = _row_format(group, "low_latency_dispatch_send", row_format)
  merged = _merged_ids(group, topk_idx)
  sent = group.backend.low_latency_dispatch_send(x, merged, fmt)
  return LowLatencySent("dispatch", (sent, topk_idx, merged, _origin(group)),
                        (fmt, np.dtype(x.dtype).name))


def low_latency_dispatch_wait(group: Group, sent: LowLatencySent):
  """Receives what `low_latency_dispatch_send` sent: `(LowLatencyResult, LowLatencyHandle)`."""
  _check_group(group, "low_latency_dispatch_wait")
  if not isinstance(sent, LowLatencySent) or sent.op != "dispatch":
    raise TypeError("jax_ep.low_latency_dispatch_wait: sent must be what "
                    f"jax_ep.low_latency_dispatch_send returned, got {type(sent).__name__}")
  state, topk_idx, merged, origin = sent.arrays
  _check_origin(group, "low_latency_dispatch_wait", origin, "low_latency_dispatch_send", "sent")
  fmt, dtype = sent.static
  outs = group.backend.low_latency_dispatch_wait(state, merged, np.dtype(dtype), fmt)
  return _low_latency_outputs(group, topk_idx, outs)


def _check_low_latency_combine(group: Group, op: str, expert_out, handle):
  _check_group(group, op)
  c = group.config
  want = (c.num_local_experts, c.low_latency_slab, c.hidden)
  _check_array(op, "expert_out", expert_out, ndim=3, dtypes=(c.dtype,),
               shape=("L", "R*T_max", "H"))
  if expert_out.shape != want:
    raise ValueError(f"jax_ep.{op}: expert_out must have shape [L, R*T_max, H] = "
                     f"{want}, got {expert_out.shape}")
  if not isinstance(handle, LowLatencyHandle):
    raise TypeError(f"jax_ep.{op}: handle must be the LowLatencyHandle returned by "
                    f"jax_ep.low_latency_dispatch, got {type(handle).__name__}")
  _check_origin(group, op, handle.origin, "low_latency_dispatch")


def _check_low_latency_weights(group: Group, op: str, handle, topk_weights):
  # bf16 / f16 router weights, as `dispatch` takes them: the reduction is fp32 either way, and
  # the cast's transpose returns their gradient in their own dtype.
  _check_array(op, "topk_weights", topk_weights, ndim=2,
               dtypes=(jnp.float32, jnp.bfloat16, jnp.float16), shape=("T", "K"))
  if topk_weights.shape != handle.topk_idx.shape:
    raise ValueError(f"jax_ep.{op}: topk_weights must have shape [T, K] = "
                     f"{handle.topk_idx.shape}, got {topk_weights.shape}")
  topk_weights = topk_weights.astype(jnp.float32)
  # A merged row carries the sum of the weights of the slots that name its expert.
  return merge_duplicate_slots(handle.topk_idx, topk_weights, group.num_experts)[1]


def low_latency_combine(group: Group, expert_out, handle: LowLatencyHandle, topk_weights):
  """Decode-time combine: `expert_out` `[L, R*T_max, H]` -> `[T, H]`, weighted by `topk_weights`:
  `out[t] = sum_k topk_weights[t, k] * expert_out[row(t, k)]` accumulated in fp32."""
  _check_low_latency_combine(group, "low_latency_combine", expert_out, handle)
  topk_weights = _check_low_latency_weights(group, "low_latency_combine", handle, topk_weights)
  return primitives.low_latency_combine(group.backend, expert_out, handle.layout, topk_weights)


def low_latency_combine_send(group: Group, expert_out, handle: LowLatencyHandle):
  """The send half of `low_latency_combine`: the expert rows leave at once; pass the result and
  the weights to `low_latency_combine_wait`. The rules of `low_latency_dispatch_send` apply."""
  _check_low_latency_combine(group, "low_latency_combine_send", expert_out, handle)
  sent = group.backend.low_latency_combine_send(expert_out, handle.layout)
  return LowLatencySent("combine", (sent, handle), np.dtype(expert_out.dtype).name)


def low_latency_combine_wait(group: Group, sent: LowLatencySent, topk_weights):
  """Receives the rows `low_latency_combine_send` sent and reduces them: `[T, H]`."""
  _check_group(group, "low_latency_combine_wait")
  if not isinstance(sent, LowLatencySent) or sent.op != "combine":
    raise TypeError("jax_ep.low_latency_combine_wait: sent must be what "
                    f"jax_ep.low_latency_combine_send returned, got {type(sent).__name__}")
  state, handle = sent.arrays
  _check_origin(group, "low_latency_combine_wait", handle.origin, "low_latency_combine_send",
                "sent")
  topk_weights = _check_low_latency_weights(group, "low_latency_combine_wait", handle,
                                            topk_weights)
  return group.backend.low_latency_combine_wait(state, handle.layout, topk_weights,
                                                np.dtype(sent.static))
