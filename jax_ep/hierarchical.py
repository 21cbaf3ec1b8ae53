"""High-throughput dispatch and combine across hosts: one network crossing per token and host.

A group whose ranks span several hosts (`jax_ep.topology`) moves a token to each host that owns
one of its experts once, whatever the number of that host's ranks that need it:

1. **Rail exchange** (network): rank `(h, l)` (host `h`, local index `l`) sends every token that
   selects an expert of host `h2` to `(h2, l)`, its *rail peer* there, with its `K` expert ids
   and weights. Fixed addresses: a block of `T_max` rows per (source host, destination host),
   the count sent after the rows (`rail` below; on the cuda backend NVSHMEM puts,
   ffi/kernels/rail_exchange.cu).
2. **Host dispatch** (peer transport): the rail peer forwards what it received over its host's
   own group, once per source host (block `h'` holds the tokens of source rank `(h', l)`, in
   token order), with the ids of the other hosts' experts masked out.
3. **Merge**: a rank's rows of local expert `e` must be ordered by (global source rank, token),
   as on one host. The host dispatch of block `h'` gives them in (local source `l`, token)
   order for the sources of host `h'`; the blocks are therefore concatenated per expert in host
   order (hosts ordered by rank, as `Topology` is), which only needs each block's group sizes.

Combine is the reverse: each block's rows go back through the host combine, which reduces
them on the expert ranks (one partial per (token, rank)) and adds the host's partials on the
rail peer (fp32, rank order, rounded to the activations' dtype: one partial per (token, host));
the rail exchange brings each host's partial home, where they are added in host order in fp32
and rounded once. The order of the sums is host-major (one host's: rank-major), which changes
the result within the rounding of the partials (`Group.combine_partial_dtype`).

The composition here is backend-independent: `host_backend` is any backend over one host's
ranks (the cuda intranode transport on GPUs, the reference on the CPU tests) and `rail` any
exchange with `reference_rail`'s semantics, so the same code is checked against the oracle on
the CPU and runs the kernels on GPUs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.config import EPConfig, default_capacity


class NetworkRouting(NamedTuple):
  """Routing metadata of the high-throughput ops across hosts (int32 unless said).

  Attributes:
    rail_pos: `[T, Hn]` row of token t in the block this rank sent host h2, or -1.
    rail_src: `[Hn, T_max]` the token of each of those rows, -1 past `rail_counts`.
    rail_counts: `[Hn]` tokens this rank sent each host.
    recv_counts: `[Hn]` tokens this rank received (and forwarded) from each host's rail peer.
    recv_weights: `[Hn, T_max, K]` float32 their weights, 0 for slots of other hosts' experts.
    host_routing: the host dispatch's routing of each block `h'` (a tuple of `Hn`).
    row_of: `[Hn, C_h]` the row of `recv_x` each row of block `h'`'s host dispatch became,
      -1 for none (unused, or dropped past `capacity`).
    gather: `[capacity]` flat index `h' * C_h + o` of the block row each row of `recv_x`
      came from, -1 past the used rows.
  """
  rail_pos: jax.Array
  rail_src: jax.Array
  rail_counts: jax.Array
  recv_counts: jax.Array
  recv_weights: jax.Array
  host_routing: tuple
  row_of: jax.Array
  gather: jax.Array


def host_config(config: EPConfig, num_hosts: int, axis_name: str | None = None) -> EPConfig:
  """The configuration of one host's group: its ranks, their experts, `T_max` tokens per
  forwarded block, and a capacity that drops no row the merge keeps.

  Drops are decided after the merge, in the whole group's row order. A row at position p of a
  block's own layout lands at p or later in the merged one, so a block needs at most the
  group's capacity (or the most rows a block can hold, if fewer); `Hierarchy._merge_maps`
  shows why the blocks' clipped sizes still place every kept row right."""
  if config.num_ranks % num_hosts:
    raise ValueError(f"jax_ep: {num_hosts} hosts must divide the group's {config.num_ranks} "
                     f"ranks")
  ranks = config.num_ranks // num_hosts
  num_local = config.num_local_experts
  never_drops = default_capacity(ranks, config.max_tokens_per_rank, config.num_topk, num_local)
  return EPConfig(axis_name or config.axis_name, ranks, ranks * num_local, config.num_topk,
                  config.hidden, config.max_tokens_per_rank, config.dtype,
                  min(never_drops, config.capacity))


def reference_rail(axis_name: str) -> Callable:
  """The rail exchange in plain JAX over a mesh axis whose index is the host (the CPU tests'
  two-axis mesh): `rail(sources, index, counts)`.

  Args (per rank):
    sources: a tuple of arrays `[N, ...]`.
    index: `[Hn, T_max]` int32: row j of the block for host h2 is `source[index[h2, j]]`, for
      `j < counts[h2]`.
    counts: `[Hn]` int32 rows of each block.

  Returns `(received, recv_counts)`: per source array `[Hn, T_max, ...]`, block h' from the
  rail peer on host h' (rows past its count zero), and `[Hn]` those counts.
  """
  def rail(sources, index, counts):
    t_max = index.shape[1]
    rows = jnp.arange(t_max, dtype=jnp.int32)[None, :]
    send_valid = (rows < counts[:, None]) & (index >= 0)
    recv_counts = jax.lax.all_to_all(counts[:, None], axis_name, 0, 0, tiled=False)[:, 0]
    recv_valid = rows < recv_counts[:, None]
    received = []
    for src in sources:
      block = src[jnp.maximum(index, 0)]
      mask = send_valid.reshape(*send_valid.shape, *([1] * (block.ndim - 2)))
      block = jnp.where(mask, block, jnp.zeros((), block.dtype))
      got = jax.lax.all_to_all(block, axis_name, 0, 0, tiled=False)
      mask = recv_valid.reshape(*recv_valid.shape, *([1] * (got.ndim - 2)))
      received.append(jnp.where(mask, got, jnp.zeros((), got.dtype)))
    return tuple(received), recv_counts
  return rail


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  """The high-throughput backend interface (`dispatch_tokens`, `dispatch`, `combine`,
  `combine_vjp`; see jax_ep/backends.py) of a group over several hosts, built from a host
  backend and a rail exchange.

  Attributes:
    config: the whole group's configuration.
    hosts: the ranks of each host, ascending; hosts of equal size, ordered by their ranks.
    host_backend: a backend over one host's ranks, configured by `host_config`.
    rail: the rail exchange (`reference_rail`'s signature and semantics).
    host_index: a traced function returning this rank's host (int32), called inside the
      per-shard function.
  """
  config: EPConfig
  hosts: tuple
  host_backend: object
  rail: Callable
  host_index: Callable

  # ------------------------------------------------------------------ static maps
  @property
  def num_hosts(self) -> int:
    return len(self.hosts)

  def _tables(self):
    r = self.config.num_ranks
    host_of = np.zeros(r, np.int32)
    local_of = np.zeros(r, np.int32)
    for h, ranks in enumerate(self.hosts):
      for g, rank in enumerate(ranks):
        host_of[rank], local_of[rank] = h, g
    return jnp.asarray(host_of), jnp.asarray(local_of)

  def _host_capacity(self) -> int:
    return self.host_backend.config.capacity

  # ------------------------------------------------------------------ pieces
  def _rail_layout(self, topk_idx):
    """Which hosts each token goes to: `(rail_pos [T, Hn], rail_src [Hn, T_max], counts)`."""
    c = self.config
    num_hosts, t_max = self.num_hosts, c.max_tokens_per_rank
    host_of, _ = self._tables()
    valid = (topk_idx >= 0) & (topk_idx < c.num_experts)
    slot_host = jnp.where(valid, host_of[jnp.where(valid, topk_idx, 0) // c.num_local_experts],
                          -1)
    hosts = jnp.arange(num_hosts, dtype=jnp.int32)
    need = jnp.any(slot_host[:, :, None] == hosts[None, None, :], axis=1)  # [T, Hn]
    pos = jnp.cumsum(need.astype(jnp.int32), axis=0) - 1
    rail_pos = jnp.where(need, pos, -1).astype(jnp.int32)
    counts = jnp.sum(need, axis=0, dtype=jnp.int32)
    num_tokens = topk_idx.shape[0]
    tokens = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], need.shape)
    host_ids = jnp.broadcast_to(hosts[None, :], need.shape)
    rail_src = jnp.full((num_hosts, t_max), -1, jnp.int32).at[
        host_ids, jnp.where(need, pos, t_max)].set(tokens, mode="drop")
    return rail_pos, rail_src, counts

  def _host_ids(self, recv_idx, recv_counts):
    """Expert ids of the forwarded blocks `[Hn, T_max, K]` as the host group numbers them:
    the experts of this rank's host, -1 for the other hosts' and rows past the counts."""
    c = self.config
    host_of, local_of = self._tables()
    num_local = c.num_local_experts
    rows = jnp.arange(c.max_tokens_per_rank, dtype=jnp.int32)[None, :, None]
    valid = (recv_idx >= 0) & (recv_idx < c.num_experts) & (rows < recv_counts[:, None, None])
    rank = jnp.where(valid, recv_idx, 0) // num_local
    mine = valid & (host_of[rank] == self.host_index())
    return jnp.where(mine, local_of[rank] * num_local + recv_idx % num_local, -1)

  def _merge_maps(self, host_sizes, host_dropped):
    """From the host dispatches' group sizes `[Hn, L]` and dropped rows `[Hn]`: `(row_of,
    gather, group_sizes, num_dropped)` of the merged layout (experts ascending, then blocks in
    host order).

    A block that dropped rows (past the group's capacity in its own layout) reports clipped
    sizes, yet every kept row lands where the unclipped sizes would put it. Let e be the lowest
    expert any block clipped and b the first block that clipped it: the sizes of experts
    before e, and of e in the blocks before b, are exact. Block b's kept rows fill `capacity`,
    so `expert_start[e] + size_b[e] >= capacity` with b's clipped size: every row of e in later
    blocks and of every later expert lands past the capacity, as it does with the true sizes.
    The drop count adds the blocks' own drops back."""
    capacity, cap_h = self.config.capacity, self._host_capacity()
    totals = jnp.sum(host_sizes, axis=0)
    expert_start = jnp.cumsum(totals) - totals                           # [L]
    block_start = jnp.cumsum(host_sizes, axis=0) - host_sizes             # [Hn, L]
    ends = jnp.cumsum(host_sizes, axis=1)                                 # [Hn, L]
    rows = jnp.arange(cap_h, dtype=jnp.int32)
    row_of, gather = [], jnp.full((capacity,), -1, jnp.int32)
    for b in range(self.num_hosts):
      expert = jnp.searchsorted(ends[b], rows, side="right").astype(jnp.int32)
      used = expert < host_sizes.shape[1]
      e = jnp.minimum(expert, host_sizes.shape[1] - 1)
      within = rows - (ends[b][e] - host_sizes[b][e])
      final = expert_start[e] + block_start[b][e] + within
      final = jnp.where(used & (final < capacity), final, -1).astype(jnp.int32)
      row_of.append(final)
      gather = gather.at[jnp.where(final >= 0, final, capacity)].set(b * cap_h + rows,
                                                                     mode="drop")
    group_sizes = jnp.clip(capacity - expert_start, 0, totals).astype(jnp.int32)
    num_dropped = jnp.maximum(jnp.sum(totals) + jnp.sum(host_dropped) - capacity,
                              0).astype(jnp.int32)
    return jnp.stack(row_of), gather, group_sizes, num_dropped

  def _merge_rows(self, blocks, gather, dtype):
    """`[capacity, H]` rows of the merged layout from the host dispatches' `[C_h, H]` each.

    One select per block over gathers from the blocks themselves, never their concatenation:
    at the default capacity most rows are the zero tail, and a concatenated copy of the blocks
    would move every one of them twice more. A row taken from another block (or none) reads
    row 0 of this one, so each output row reads one real row."""
    cap_h = self._host_capacity()
    block, row = gather // max(cap_h, 1), gather % max(cap_h, 1)
    out = jnp.zeros((gather.shape[0], blocks[0].shape[-1]), dtype)
    for b, rows in enumerate(blocks):
      take = (gather >= 0) & (block == b)
      out = jnp.where(take[:, None], rows[jnp.where(take, row, 0)].astype(dtype), out)
    return out

  def _split_rows(self, expert_out, row_of):
    """Per block, the `[C_h, H]` rows its host combine takes, from the merged layout."""
    out = []
    for b in range(self.num_hosts):
      rows = expert_out[jnp.maximum(row_of[b], 0)] if expert_out.shape[0] else jnp.zeros(
          (row_of.shape[1], expert_out.shape[-1]), expert_out.dtype)
      out.append(jnp.where((row_of[b] >= 0)[:, None], rows, jnp.zeros((), expert_out.dtype)))
    return out

  def _rail_back(self, blocks, routing: NetworkRouting):
    """The forwarded blocks' per-(token, host) results `[Hn, T_max, ...]` home: each home token
    gets `[Hn, ...]`, its row of every host (zeros from hosts it did not go to)."""
    num_hosts, t_max = self.num_hosts, self.config.max_tokens_per_rank
    identity = (jnp.arange(num_hosts, dtype=jnp.int32)[:, None] * t_max
                + jnp.arange(t_max, dtype=jnp.int32)[None, :])
    sources = tuple(b.reshape(num_hosts * t_max, *b.shape[2:]) for b in blocks)
    back, _ = self.rail(sources, identity, routing.recv_counts)
    out = []
    for got in back:  # [Hn (host it was reduced on), T_max, ...]
      pos = routing.rail_pos  # [T, Hn]
      picked = got[jnp.arange(num_hosts)[None, :], jnp.maximum(pos, 0)]  # [T, Hn, ...]
      mask = (pos >= 0).reshape(*pos.shape, *([1] * (picked.ndim - 2)))
      out.append(jnp.where(mask, picked, jnp.zeros((), picked.dtype)))
    return out

  # ------------------------------------------------------------------ backend interface
  def dispatch_tokens(self, x, topk_idx, topk_weights):
    c = self.config
    invalid = jnp.sum((topk_idx < -1) | (topk_idx >= c.num_experts), dtype=jnp.int32)
    clean = jnp.where((topk_idx >= 0) & (topk_idx < c.num_experts), topk_idx, -1)
    rail_pos, rail_src, counts = self._rail_layout(clean)
    (recv_x, recv_idx, recv_w), recv_counts = self.rail(
        (x, clean.astype(jnp.int32), topk_weights.astype(jnp.float32)), rail_src, counts)
    host_idx = self._host_ids(recv_idx, recv_counts)
    recv_w = jnp.where(host_idx >= 0, recv_w, 0.0)
    blocks, sizes, dropped, host_routing = [], [], [], []
    for b in range(self.num_hosts):
      out = self.host_backend.dispatch_tokens(recv_x[b], host_idx[b], recv_w[b])
      blocks.append(out[0])
      sizes.append(out[1])
      dropped.append(out[2])
      host_routing.append(out[-1])
    row_of, gather, group_sizes, num_dropped = self._merge_maps(jnp.stack(sizes),
                                                                jnp.stack(dropped))
    routing = NetworkRouting(rail_pos, rail_src, counts, recv_counts, recv_w,
                             tuple(host_routing), row_of, gather)
    return (self._merge_rows(blocks, gather, x.dtype), group_sizes, num_dropped, invalid,
            routing)

  def dispatch(self, x, routing: NetworkRouting, slot_weights=None):
    (recv_x,), _ = self.rail((x,), routing.rail_src, routing.rail_counts)
    blocks = []
    for b in range(self.num_hosts):
      weights = None if slot_weights is None else routing.recv_weights[b]
      blocks.append(self.host_backend.dispatch(recv_x[b], routing.host_routing[b], weights))
    return self._merge_rows(blocks, routing.gather, x.dtype)

  def combine(self, expert_out, routing: NetworkRouting, slot_weights=None):
    # Each host combine reads its block's rows where they sit in the merged layout (its routing
    # renamed by `row_of`), not from a copy of them: the copies would move every block's zero
    # tail too. A host backend without `rename_rows`, or a merged layout of no rows (capacity
    # 0, which the host combines would receive as their operand), gets the copies.
    host = self.host_backend
    if hasattr(host, "rename_rows") and expert_out.shape[0]:
      inputs = [(expert_out, host.rename_rows(routing.host_routing[b], routing.row_of[b]))
                for b in range(self.num_hosts)]
    else:
      inputs = list(zip(self._split_rows(expert_out, routing.row_of), routing.host_routing))
    parts = []
    for b, (rows, host_routing) in enumerate(inputs):
      weights = None if slot_weights is None else routing.recv_weights[b]
      parts.append(host.combine(rows, host_routing, weights))
    (picked,) = self._rail_back((jnp.stack(parts),), routing)  # [T, Hn, H]
    total = picked[:, 0].astype(jnp.float32)
    for h in range(1, self.num_hosts):
      total = total + picked[:, h].astype(jnp.float32)
    return total.astype(expert_out.dtype)

  def combine_vjp(self, d_out, expert_out, routing: NetworkRouting, slot_weights):
    (recv_d,), _ = self.rail((d_out.astype(expert_out.dtype),), routing.rail_src,
                             routing.rail_counts)
    d_blocks, dots = [], []
    for b, rows in enumerate(self._split_rows(expert_out, routing.row_of)):
      d_rows, d_w = self.host_backend.combine_vjp(recv_d[b], rows, routing.host_routing[b],
                                                  routing.recv_weights[b])
      d_blocks.append(d_rows)
      dots.append(d_w.astype(jnp.float32))
    (picked,) = self._rail_back((jnp.stack(dots),), routing)  # [T, Hn, K]
    # A slot's expert lives on one host: the other hosts' dots for it are zero.
    return (self._merge_rows(d_blocks, routing.gather, expert_out.dtype),
            jnp.sum(picked, axis=1))
