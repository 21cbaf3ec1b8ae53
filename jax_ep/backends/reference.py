"""Reference backend: the contract's semantics in plain JAX, for any platform.

The functions below take the group's `EPConfig`; `ReferenceBackend` at the end is the backend
object (jax_ep/backends/base.py) a group on the reference backend holds.

Per-shard functions, called inside `shard_map` over `config.axis_name`. Communication is
`jax.lax.all_to_all` on padded per-destination blocks (one block of `T` rows per destination
rank, every token sent at most once per rank), so nothing here needs `ragged_all_to_all` (not
implemented on XLA:CPU). Reductions run in a fixed order (static loops), so results are
deterministic on every platform.

Shapes: `T` tokens on this rank, `K` top-k, `H` hidden, `R` ranks, `L` local experts,
`C` capacity. An *entry* is a (source rank, token, slot) triple as seen by the receiver,
flattened as `(s * T + t) * K + k`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.backends.base import Backend, LayoutThenDispatch
from jax_ep._native.fp8 import fp8_quantize, pack_ue8m0
from jax_ep.config import EPConfig, RowFormat


class ReferenceLayout(NamedTuple):
  """Where the reference backend's high-throughput dispatch put its rows, kept in the handle
  (all int32).

  Attributes:
    dest_rank: `[T, K]` rank each of this rank's slots goes to, -1 for a slot that selects nothing.
    entry_row: `[R, T, K]` on the receiver: row of `recv_x` holding entry (s, t, k), or -1
      (not routed here, invalid, or dropped).
    row_entry: `[C]` on the receiver: the entry each row of `recv_x` came from, or -1 for a
      row no entry went to (past the groups, and `expert_alignment`'s padding between them).
  """
  dest_rank: jax.Array
  entry_row: jax.Array
  row_entry: jax.Array


class ReferenceLowLatencyLayout(NamedTuple):
  """Where the reference backend's low-latency dispatch put its rows (int32).

  Attributes:
    dest_rank: `[T, K]` as in `ReferenceLayout`.
    entry_slot: `[R, T, K]` on the receiver: flat index `le * (R * T_max) + j` of entry (s, t, k)
      in `recv_x.reshape(L * R * T_max, H)`, or -1.
  """
  dest_rank: jax.Array
  entry_slot: jax.Array


def _exchange(config: EPConfig, blocks: jax.Array) -> jax.Array:
  """`blocks[d]` goes to rank d; returns `[R, ...]` indexed by source rank."""
  return jax.lax.all_to_all(blocks, config.axis_name, 0, 0, tiled=False)


def _slot_destinations(config: EPConfig, topk_idx: jax.Array):
  """Per slot: destination rank and local expert (-1 when the slot selects nothing)."""
  valid = (topk_idx >= 0) & (topk_idx < config.num_experts)
  num_local = config.num_local_experts
  dest = jnp.where(valid, topk_idx // num_local, -1).astype(jnp.int32)
  local_expert = jnp.where(valid, topk_idx % num_local, -1).astype(jnp.int32)
  invalid = (topk_idx < -1) | (topk_idx >= config.num_experts)
  return dest, local_expert, jnp.sum(invalid, dtype=jnp.int32)


def _per_destination(config: EPConfig, dest: jax.Array, values: jax.Array, fill) -> jax.Array:
  """`[R, T, K]`: `values` where the slot goes to rank d, else `fill`."""
  ranks = jnp.arange(config.num_ranks, dtype=jnp.int32)[:, None, None]
  return jnp.where(dest[None] == ranks, values[None], fill)


def _token_blocks(config: EPConfig, dest: jax.Array, x: jax.Array) -> jax.Array:
  """`[R, T, H]`: token t in block d iff one of its slots goes to rank d (deduplicated per rank)."""
  ranks = jnp.arange(config.num_ranks, dtype=jnp.int32)[:, None]
  goes = jnp.any(dest[None, :, :] == ranks[:, :, None], axis=-1)  # [R, T]
  return jnp.where(goes[..., None], x[None], jnp.zeros((), x.dtype))


def _rank_within_group(keys: jax.Array, num_groups: int):
  """For flat `keys` in [0, num_groups] (num_groups = "none"), each entry's position in the
  stable order by key, its rank inside its own key group, the stable order and counts per key."""
  order = jnp.argsort(keys, stable=True).astype(jnp.int32)
  position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
  counts = jnp.bincount(keys, length=num_groups + 1)[:num_groups].astype(jnp.int32)
  offsets = jnp.cumsum(counts) - counts
  clipped = jnp.minimum(keys, num_groups - 1)
  rank_in_group = position - offsets[clipped]
  return position, rank_in_group, order, counts, offsets


def expert_bases(counts: jax.Array, expert_alignment: int) -> jax.Array:
  """`[L]` int32 first row of each expert's rows for `counts` `[L]` rows per expert (before any
  drop): the exclusive cumulative sum of the counts, each rounded up to a multiple of
  `expert_alignment`. Row j of expert l is `base[l] + j`, kept where it is `< capacity`."""
  padded = counts.astype(jnp.int32)
  if expert_alignment > 1:
    padded = (padded + (expert_alignment - 1)) // expert_alignment * expert_alignment
  return (jnp.cumsum(padded) - padded).astype(jnp.int32)


def layout(config: EPConfig, topk_idx: jax.Array):
  """Notify + layout: exchange routing entries, assign every received entry its row.

  Expert l's rows start at `expert_bases(...)[l]` (a multiple of `config.expert_alignment`),
  in (source rank, token) order; a row at or past the capacity drops.

  Returns `(layout, group_sizes [L], num_dropped [], num_invalid [])`.
  """
  num_local, capacity = config.num_local_experts, config.capacity
  dest, local_expert, num_invalid = _slot_destinations(config, topk_idx)
  recv_expert = _exchange(config, _per_destination(config, dest, local_expert, -1))  # [R, T, K]
  keys = jnp.where(recv_expert >= 0, recv_expert, num_local).reshape(-1)
  _, rank_in_group, _, counts, _ = _rank_within_group(keys, num_local)
  base = expert_bases(counts, config.expert_alignment)
  routed = keys < num_local
  row = base[jnp.minimum(keys, num_local - 1)] + rank_in_group
  kept = routed & (row < capacity)
  entry_row = jnp.where(kept, row, -1).reshape(recv_expert.shape).astype(jnp.int32)
  entries = jnp.arange(keys.shape[0], dtype=jnp.int32)
  row_entry = jnp.full((capacity,), -1, jnp.int32).at[jnp.where(kept, row, capacity)].set(
      entries, mode="drop")
  group_sizes = jnp.clip(capacity - base, 0, counts).astype(jnp.int32)
  num_dropped = (jnp.sum(counts) - jnp.sum(group_sizes)).astype(jnp.int32)
  return ReferenceLayout(dest, entry_row, row_entry), group_sizes, num_dropped, num_invalid


def _place_rows(config: EPConfig, recv_tokens: jax.Array, row_entry: jax.Array,
                entry_scale: jax.Array | None, dtype) -> jax.Array:
  """`[C, H]`: row p = token of entry row_entry[p] (times its scale), zeros where -1."""
  k = config.num_topk
  used = row_entry >= 0
  entry = jnp.where(used, row_entry, 0)
  rows = recv_tokens.reshape(-1, recv_tokens.shape[-1])[entry // k]
  if entry_scale is not None:
    rows = rows.astype(jnp.float32) * entry_scale.reshape(-1)[entry][:, None]
  return jnp.where(used[:, None], rows, 0).astype(dtype)


def dispatch_cached(config: EPConfig, x: jax.Array, layout: ReferenceLayout,
                    topk_weights: jax.Array | None = None) -> jax.Array:
  """Rows of `x` into the receivers' expert-grouped rows `[C, H]`, placed by `layout`.

  With `topk_weights` `[T, K]` each placed row is scaled by its slot's weight (fp32 product,
  rounded once): the transpose of the weighted combine.
  """
  recv_tokens = _exchange(config, _token_blocks(config, layout.dest_rank, x))
  entry_scale = None
  if topk_weights is not None:
    entry_scale = _exchange(config, _per_destination(config, layout.dest_rank, topk_weights,
                                                     0.0))
  return _place_rows(config, recv_tokens, layout.row_entry, entry_scale, x.dtype)


def _gather_entries(expert_rows: jax.Array, entry_index: jax.Array, k: int) -> jax.Array:
  """`[R, T, H]` fp32 rows of slot k for every received (s, t), zero where the index is -1."""
  idx = entry_index[..., k]
  if expert_rows.shape[0] == 0:  # capacity 0: every entry was dropped
    return jnp.zeros((*idx.shape, expert_rows.shape[-1]), jnp.float32)
  rows = expert_rows[jnp.maximum(idx, 0)].astype(jnp.float32)
  return jnp.where((idx >= 0)[..., None], rows, 0.0)


def _sum_home(config: EPConfig, partial: jax.Array) -> jax.Array:
  """Send per-(token, rank) fp32 partials home and add them in rank order."""
  home = _exchange(config, partial)  # [R (expert rank), T, H]
  total = home[0]
  for r in range(1, config.num_ranks):
    total = total + home[r]
  return total


def combine(config: EPConfig, expert_out: jax.Array, layout: ReferenceLayout,
            topk_weights: jax.Array | None = None) -> jax.Array:
  """Reverse path: `[C, H]` expert rows -> `[T, H]` on the home rank, fp32 accumulation.

  On the expert side each (source token) sums its local rows in slot order (weighted when
  `topk_weights` is given); one fp32 row per (token, rank) travels home; home adds ranks in order.
  """
  entry_weight = None
  if topk_weights is not None:
    entry_weight = _exchange(config, _per_destination(config, layout.dest_rank, topk_weights,
                                                      0.0))
  partial = None
  for k in range(config.num_topk):
    rows = _gather_entries(expert_out, layout.entry_row, k)
    if entry_weight is not None:
      rows = rows * entry_weight[..., k][..., None]
    partial = rows if partial is None else partial + rows
  return _sum_home(config, partial).astype(expert_out.dtype)


def combine_vjp(config: EPConfig, d_out: jax.Array, expert_out: jax.Array,
                layout: ReferenceLayout, topk_weights: jax.Array):
  """Cotangents of the weighted combine: `(d_expert_out [C, H], d_topk_weights [T, K] f32)`.

  One exchange of `d_out` serves both: d_expert_out is its weighted dispatch, and each slot's
  weight gradient `<d_out[t], expert_out[row]>` is a dot taken on the expert side and sent home.
  """
  dest = layout.dest_rank
  recv_d = _exchange(config, _token_blocks(config, dest, d_out))  # [R, T, H]
  entry_weight = _exchange(config, _per_destination(config, dest, topk_weights, 0.0))
  d_expert_out = _place_rows(config, recv_d, layout.row_entry, entry_weight, expert_out.dtype)
  recv_d32 = recv_d.astype(jnp.float32)
  dots = jnp.stack([jnp.sum(recv_d32 * _gather_entries(expert_out, layout.entry_row, k), axis=-1)
                    for k in range(config.num_topk)], axis=-1)  # [R (src), T, K]
  home = _exchange(config, dots)  # [R (expert rank), T, K]
  picked = jnp.take_along_axis(home, jnp.maximum(dest, 0)[None], axis=0)[0]
  return d_expert_out, jnp.where(dest >= 0, picked, 0.0)


# ----------------------------------------------------------------------------------------------
# fp8 rows (both modes) and the low-latency mode

def fp8_rows(config: EPConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """What the high-throughput fp8 dispatch sends for `x` `[T, H]` (the activations): each token
  quantised once, on its own rank (`fp8_quantize` in the group's `wire_format`): `(q [T, H]
  float8_e4m3fn, scales)`, the scales `[T, H/128]` float32, or UE8M0-packed `[T, H/512]`
  int32."""
  fmt = config.wire_format
  q, scales = fp8_quantize(x, round_scale=fmt.pow2_scales)
  return q, (pack_ue8m0(scales) if fmt.ue8m0 else scales)


def low_latency_dispatch(config: EPConfig, x: jax.Array, topk_idx: jax.Array,
                         row_format: RowFormat = RowFormat.PLAIN):
  """Returns `(recv_x [L, R*T_max, H], scales or None, count [L], num_dropped, num_invalid,
  layout)`. `row_format` (`RowFormat`): PLAIN rows in x's dtype, or e4m3 rows with float32
  scales `[L, R*T_max, H/128]` (powers of two with FP8_POW2_SCALES), or UE8M0 scales packed
  `[L, R*T_max, H/512]` int32 (FP8_UE8M0)."""
  use_fp8 = row_format.is_fp8
  round_scale, use_ue8m0 = row_format.pow2_scales, row_format.ue8m0
  num_local, slab, hidden = config.num_local_experts, config.low_latency_slab, config.hidden
  dest, local_expert, num_invalid = _slot_destinations(config, topk_idx)
  recv_expert = _exchange(config, _per_destination(config, dest, local_expert, -1))  # [R, T, K]
  keys = jnp.where(recv_expert >= 0, recv_expert, num_local).reshape(-1)
  _, rank_in_group, order, counts, offsets = _rank_within_group(keys, num_local)
  kept = (keys < num_local) & (rank_in_group < slab)
  entry_slot = jnp.where(kept, jnp.minimum(keys, num_local - 1) * slab + rank_in_group, -1)
  entry_slot = entry_slot.reshape(recv_expert.shape).astype(jnp.int32)
  # Row j of expert le is the entry at sorted position offsets[le] + j, if j < count[le].
  j = jnp.arange(slab, dtype=jnp.int32)[None, :]
  sorted_pos = offsets[:, None] + j
  slot_used = j < jnp.minimum(counts, slab)[:, None]
  slot_entry = jnp.where(slot_used, order[jnp.minimum(sorted_pos, order.shape[0] - 1)], 0)
  token_of_slot = (slot_entry // config.num_topk).reshape(-1)

  payload, scales = (x, None)
  if use_fp8:
    payload, scales = fp8_quantize(x, round_scale=round_scale)
  recv_tokens = _exchange(config, _token_blocks(config, dest, payload)).reshape(-1, hidden)
  recv_x = jnp.where(slot_used.reshape(-1)[:, None], recv_tokens[token_of_slot],
                     jnp.zeros((), payload.dtype)).reshape(num_local, slab, hidden)
  recv_scales = None
  if use_fp8:
    sblocks = _token_blocks(config, dest, scales)
    recv_s = _exchange(config, sblocks).reshape(-1, scales.shape[-1])
    recv_scales = jnp.where(slot_used.reshape(-1)[:, None], recv_s[token_of_slot], 0.0)
    recv_scales = recv_scales.reshape(num_local, slab, scales.shape[-1])
    if use_ue8m0:
      recv_scales = pack_ue8m0(recv_scales)
  count = jnp.minimum(counts, slab).astype(jnp.int32)
  num_dropped = jnp.sum(jnp.maximum(counts - slab, 0)).astype(jnp.int32)
  return (recv_x, recv_scales, count, num_dropped, num_invalid,
          ReferenceLowLatencyLayout(dest, entry_slot))


def low_latency_combine(config: EPConfig, expert_out: jax.Array,
                        layout: ReferenceLowLatencyLayout, topk_weights: jax.Array) -> jax.Array:
  """Each selected slot's expert row travels home; home takes the fp32 weighted sum in slot
  order."""
  flat = expert_out.reshape(-1, expert_out.shape[-1])
  rows = jnp.stack([_gather_entries(flat, layout.entry_slot, k) for k in range(config.num_topk)],
                   axis=2)  # [R (src), T, K, H] fp32
  home = _exchange(config, rows.astype(expert_out.dtype))  # [R (expert rank), T, K, H]
  dest = layout.dest_rank
  picked = jnp.take_along_axis(home, jnp.maximum(dest, 0)[None, :, :, None], axis=0)[0]
  kept_weights = jnp.where(dest >= 0, topk_weights, 0.0)
  out = None
  for k in range(config.num_topk):
    term = kept_weights[:, k, None] * picked[:, k].astype(jnp.float32)
    out = term if out is None else out + term
  return out.astype(expert_out.dtype)


def scratch_bytes(config: EPConfig, num_tokens: int | None = None) -> int:
  """Transient bytes the reference's exchanges allocate per high-throughput call and rank."""
  t = config.max_tokens_per_rank if num_tokens is None else num_tokens
  itemsize = np.dtype(config.dtype).itemsize
  token_blocks = 2 * config.num_ranks * t * config.hidden * itemsize  # send + receive
  partials = 2 * config.num_ranks * t * config.hidden * 4  # fp32 partial sums, send + receive
  return token_blocks + partials


# ----------------------------------------------------------------------------------------------
# The backend

@dataclasses.dataclass(frozen=True)
class ReferenceBackend(LayoutThenDispatch, Backend):
  """Pure JAX; runs on every platform. The oracle-checked baseline for all other backends.

  JAX differentiates the low-latency pair as written (`low_latency_kernels` False), so it takes
  no `topk_weights` in its dispatch and no `gather`. Its split form computes everything in the
  send and hands it to the wait (nothing of it can overlap on this path).
  """
  config: EPConfig
  name = "reference"
  low_latency_kernels = False

  def layout(self, topk_idx):
    return layout(self.config, topk_idx)

  def dispatch_cached(self, x, layout, topk_weights=None):
    return dispatch_cached(self.config, x, layout, topk_weights)

  def dispatch_fp8(self, x, x_scales, topk_idx, topk_weights):
    # The closed form: every token quantised once on its own rank, then its e4m3 row and its
    # scales placed as a plain dispatch places rows (both along one layout).
    del topk_weights  # travels with the handle, as in `dispatch`
    q, scales = fp8_rows(self.config, x) if x_scales is None else (x, x_scales)
    layout, group_sizes, num_dropped, num_invalid = self.layout(topk_idx)
    return (self.dispatch_cached(q, layout), self.dispatch_cached(scales, layout), group_sizes,
            num_dropped, num_invalid, layout)

  def combine(self, expert_out, layout, topk_weights=None):
    return combine(self.config, expert_out, layout, topk_weights)

  def combine_vjp(self, d_out, expert_out, layout, topk_weights):
    return combine_vjp(self.config, d_out, expert_out, layout, topk_weights)

  def low_latency_dispatch(self, x, topk_idx, row_format, topk_weights=None):
    if topk_weights is not None:
      raise NotImplementedError("jax_ep: the reference backend's low-latency dispatch takes no "
                                "topk_weights (JAX differentiates it as written)")
    return low_latency_dispatch(self.config, x, topk_idx, row_format)

  def low_latency_combine(self, expert_out, layout, topk_weights, gather=False):
    if gather:
      raise NotImplementedError("jax_ep: the reference backend's low-latency combine takes no "
                                "gather (JAX differentiates it as written)")
    return low_latency_combine(self.config, expert_out, layout, topk_weights)

  def low_latency_dispatch_send(self, x, topk_idx, row_format):
    return self.low_latency_dispatch(x, topk_idx, row_format)

  def low_latency_dispatch_wait(self, sent, topk_idx, x_dtype, row_format):
    del topk_idx, x_dtype, row_format
    return sent

  def low_latency_combine_send(self, expert_out, layout):
    return (expert_out, layout)

  def low_latency_combine_wait(self, sent, layout, topk_weights, dtype):
    del layout, dtype
    expert_out, layout = sent
    return self.low_latency_combine(expert_out, layout, topk_weights)
