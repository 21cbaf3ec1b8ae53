"""High-throughput dispatch and combine across hosts: one network crossing per token and host.

A group whose ranks span several hosts (`jax_ep.backends.topology`) moves a token to each host
that owns one of its experts once, whatever the number of that host's ranks that need it:

1. **Rail exchange** (network): rank `(h, l)` (host `h`, local index `l`) sends every token that
   selects an expert of host `h2` to `(h2, l)`, its *rail peer* there, with its `K` expert ids
   and weights. Fixed addresses: a block of `T_max` rows per (source host, destination host),
   the count sent after the rows (`rail_exchange` below; on the cuda backend NVSHMEM puts,
   ffi/kernels/rail_exchange.cu).
2. **Host dispatch** (peer transport): the rail peer forwards what it received over its host's
   own group in one dispatch of `Hn * T_max` tokens (block `h'`, the tokens of source rank
   `(h', l)` in token order, at rows `h' * T_max ...`). That group numbers each expert once
   per source host: local expert `e` of host rank `g` is the host group's expert
   `(g * L + e) * Hn + h'` for the rows from host `h'` (`host_config`), the ids of the other
   hosts' experts masked out.

Why one dispatch gives the whole group's layout: the host group orders a rank's rows by its
expert, then by forwarding rank `l`, then by token. The rows of expert `e` are its `Hn` host
experts in a row, so they come ordered by (source host `h'`, source local index `l`, token),
which is (global source rank, token), the contract's order, as long as a host's ranks are
contiguous in rank order (`contiguous_hosts`; `Hierarchy` takes no other hosts). The host
dispatch's group sizes summed per `Hn` are the group's, and its capacity is the group's, so
its drops are the group's too: no merge, no renumbering of rows.

Combine is the reverse: the host combine reduces the rows on the expert ranks (one partial per
(token, rank)) and adds the host's partials on the rail peer (fp32, rank order, rounded to the
activations' dtype: one partial per (token, host)); the rail exchange brings each host's
partial home, where they are added in host order in fp32 and rounded once. The order of the
sums is host-major (one host's: rank-major), which changes the result within the rounding of
the partials (`Group.combine_partial_dtype`).

The composition here is backend-independent: `host_backend` is any backend over one host's
ranks (the cuda peer transport on GPUs, the reference on the CPU tests) and
`rail_exchange` any exchange with `reference_rail_exchange`'s semantics, so the same code is
checked against the oracle on the CPU and runs the kernels on GPUs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.backends.base import HighThroughputBackend
from jax_ep._native.fp8 import fp8_quantize, pack_ue8m0
from jax_ep.config import EPConfig


class NetworkLayout(NamedTuple):
  """Where the high-throughput dispatch across hosts put its rows, kept in the handle (int32
  unless said).

  Attributes:
    rail_pos: `[T, Hn]` row of token t in the block this rank sent host h2, or -1.
    rail_src: `[Hn, T_max]` the token of each of those rows, -1 past `rail_counts`.
    rail_counts: `[Hn]` tokens this rank sent each host.
    recv_counts: `[Hn]` tokens this rank received (and forwarded) from each host's rail peer.
    recv_weights: `[Hn, T_max, K]` float32 their `topk_weights` as received, 0 for slots of
      other hosts' experts (the host dispatch's `topk_weights`, stacked).
    host_layout: the host dispatch's layout of the forwarded blocks, stacked.
  """
  rail_pos: jax.Array
  rail_src: jax.Array
  rail_counts: jax.Array
  recv_counts: jax.Array
  recv_weights: jax.Array
  host_layout: object


def host_config(config: EPConfig, num_hosts: int, axis_name: str | None = None) -> EPConfig:
  """The configuration of one host's group: its ranks, each local expert once per source host
  (`L * Hn` host experts per rank, `E` in all), the `Hn` forwarded blocks of `T_max` tokens as
  one call, and the group's capacity (its row order and drops are the group's: module
  docstring)."""
  if config.num_ranks % num_hosts:
    raise ValueError(f"jax_ep: {num_hosts} hosts must divide the group's {config.num_ranks} "
                     f"ranks")
  ranks = config.num_ranks // num_hosts
  return EPConfig(axis_name or config.axis_name, ranks, config.num_experts,
                  config.num_topk, config.hidden, num_hosts * config.max_tokens_per_rank,
                  config.dtype, config.capacity, wire_format=config.wire_format)


def reference_quantize(config: EPConfig) -> Callable:
  """`quantize(x)`: the fp8 rows `(q [T, H] e4m3, scales)` of the activations `x` in
  `config.wire_format`, in plain JAX (`jax_ep._native.fp8`, the closed form's rounding)."""
  fmt = config.wire_format

  def quantize(x):
    q, scales = fp8_quantize(x, round_scale=fmt.pow2_scales)
    return q, (pack_ue8m0(scales) if fmt.ue8m0 else scales)
  return quantize


def contiguous_hosts(hosts) -> bool:
  """Whether `hosts` (ranks per host) are of equal size and host h holds ranks `h * G ...`:
  the hosts whose (host, local index) order is the rank order the contract orders rows by."""
  size = len(hosts[0]) if hosts else 0
  return bool(hosts) and all(tuple(ranks) == tuple(range(h * size, (h + 1) * size))
                             for h, ranks in enumerate(hosts))


def reference_rail_exchange(axis_name: str) -> Callable:
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
class Hierarchy(HighThroughputBackend):
  """The high-throughput backend interface (`dispatch`, `dispatch_cached`, `combine`,
  `combine_vjp`; jax_ep/backends/base.py) of a group over several hosts, built from a host
  backend and a rail exchange.

  Attributes:
    config: the whole group's configuration.
    hosts: the ranks of each host, ascending; hosts of equal size, contiguous in rank order
      (`contiguous_hosts`), ordered by their ranks.
    host_backend: a backend over one host's ranks, configured by `host_config`.
    rail_exchange: the rail exchange (`reference_rail_exchange`'s signature and semantics).
    host_index: a traced function returning this rank's host (int32), called inside the
      per-shard function.
    quantize: `x -> (q, scales)`, the fp8 rows of an fp8 dispatch's activations in the
      group's `wire_format` (`reference_quantize`'s semantics; None: it); each token is
      quantised once, on its own rank, and its e4m3 row and scales cross the network.
  """
  config: EPConfig
  hosts: tuple
  host_backend: HighThroughputBackend
  rail_exchange: Callable
  host_index: Callable
  quantize: Callable | None = None

  def __post_init__(self):
    if self.config.expert_alignment > 1:
      raise ValueError(
          f"jax_ep.hierarchical: expert_alignment={self.config.expert_alignment} is not "
          f"implemented across hosts (the host group lays out each expert's rows as one group "
          f"per source host, so no one prefix sum places the padding); use expert_alignment=1")
    if not contiguous_hosts(self.hosts):
      raise ValueError(f"jax_ep.hierarchical: hosts must be of equal size and contiguous in "
                       f"rank order, got {self.hosts}")

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
    `(g * L + e) * Hn + h'` for expert e of host rank g in block h', -1 for the other hosts'
    experts and rows past the counts."""
    c = self.config
    host_of, local_of = self._tables()
    num_local, num_hosts = c.num_local_experts, self.num_hosts
    rows = jnp.arange(c.max_tokens_per_rank, dtype=jnp.int32)[None, :, None]
    block = jnp.arange(num_hosts, dtype=jnp.int32)[:, None, None]
    valid = (recv_idx >= 0) & (recv_idx < c.num_experts) & (rows < recv_counts[:, None, None])
    rank = jnp.where(valid, recv_idx, 0) // num_local
    mine = valid & (host_of[rank] == self.host_index())
    host_expert = local_of[rank] * num_local + recv_idx % num_local
    return jnp.where(mine, host_expert * num_hosts + block, -1).astype(jnp.int32)

  def _stacked(self, blocks):
    """`[Hn, T_max, ...]` -> `[Hn * T_max, ...]`: the host dispatch's tokens."""
    return blocks.reshape(blocks.shape[0] * blocks.shape[1], *blocks.shape[2:])

  def _blocks(self, stacked):
    """`[Hn * T_max, ...]` -> `[Hn, T_max, ...]`."""
    return stacked.reshape(self.num_hosts, self.config.max_tokens_per_rank, *stacked.shape[1:])

  def _rail_back(self, blocks, layout: NetworkLayout):
    """The forwarded blocks' per-(token, host) results `[Hn, T_max, ...]` home: each home token
    gets `[Hn, ...]`, its row of every host (zeros from hosts it did not go to)."""
    num_hosts, t_max = self.num_hosts, self.config.max_tokens_per_rank
    identity = (jnp.arange(num_hosts, dtype=jnp.int32)[:, None] * t_max
                + jnp.arange(t_max, dtype=jnp.int32)[None, :])
    sources = tuple(b.reshape(num_hosts * t_max, *b.shape[2:]) for b in blocks)
    back, _ = self.rail_exchange(sources, identity, layout.recv_counts)
    out = []
    for got in back:  # [Hn (host it was reduced on), T_max, ...]
      pos = layout.rail_pos  # [T, Hn]
      picked = got[jnp.arange(num_hosts)[None, :], jnp.maximum(pos, 0)]  # [T, Hn, ...]
      mask = (pos >= 0).reshape(*pos.shape, *([1] * (picked.ndim - 2)))
      out.append(jnp.where(mask, picked, jnp.zeros((), picked.dtype)))
    return out

  # ------------------------------------------------------------------ backend interface
  def _dispatch(self, rows, topk_idx, topk_weights, host_dispatch):
    """The rail exchange of `rows` (a tuple of per-token arrays) with the routing, then
    `host_dispatch(stacked rows..., host ids, host weights)` -> `(*placed, host_sizes,
    num_dropped, num_invalid, host_layout)`. Returns `(*placed, group_sizes, num_dropped,
    num_invalid, layout)`."""
    c = self.config
    invalid = jnp.sum((topk_idx < -1) | (topk_idx >= c.num_experts), dtype=jnp.int32)
    clean = jnp.where((topk_idx >= 0) & (topk_idx < c.num_experts), topk_idx, -1)
    rail_pos, rail_src, counts = self._rail_layout(clean)
    (*recv_rows, recv_idx, recv_w), recv_counts = self.rail_exchange(
        (*rows, clean.astype(jnp.int32), topk_weights.astype(jnp.float32)), rail_src, counts)
    host_idx = self._host_ids(recv_idx, recv_counts)
    recv_w = jnp.where(host_idx >= 0, recv_w, 0.0)
    *placed, host_sizes, num_dropped, _, host_layout = host_dispatch(
        *(self._stacked(r) for r in recv_rows), self._stacked(host_idx),
        self._stacked(recv_w))
    group_sizes = jnp.sum(host_sizes.reshape(c.num_local_experts, self.num_hosts), axis=1,
                          dtype=jnp.int32)
    layout = NetworkLayout(rail_pos, rail_src, counts, recv_counts, recv_w, host_layout)
    return (*placed, group_sizes, num_dropped, invalid, layout)

  def dispatch(self, x, topk_idx, topk_weights):
    return self._dispatch((x,), topk_idx, topk_weights, self.host_backend.dispatch)

  def dispatch_fp8(self, x, x_scales, topk_idx, topk_weights):
    """The fp8 dispatch across hosts: each token quantised once on its own rank (unless it
    came as e4m3 rows with `x_scales`), its e4m3 row and scales sent over the rail, then the
    host group's fp8 dispatch of them as given. Returns `dispatch`'s results with the scales
    after the rows (`base.HighThroughputBackend.dispatch_fp8`)."""
    if x_scales is None:
      quantize = self.quantize or reference_quantize(self.config)
      x, x_scales = quantize(x)
    return self._dispatch((x, x_scales), topk_idx, topk_weights,
                          self.host_backend.dispatch_fp8)

  def dispatch_cached(self, x, layout: NetworkLayout, topk_weights=None):
    (recv_x,), _ = self.rail_exchange((x,), layout.rail_src, layout.rail_counts)
    host_weights = None if topk_weights is None else self._stacked(layout.recv_weights)
    return self.host_backend.dispatch_cached(self._stacked(recv_x), layout.host_layout,
                                             host_weights)

  def combine(self, expert_out, layout: NetworkLayout, topk_weights=None):
    host_weights = None if topk_weights is None else self._stacked(layout.recv_weights)
    part = self.host_backend.combine(expert_out, layout.host_layout, host_weights)
    (picked,) = self._rail_back((self._blocks(part),), layout)  # [T, Hn, H]
    total = picked[:, 0].astype(jnp.float32)
    for h in range(1, self.num_hosts):
      total = total + picked[:, h].astype(jnp.float32)
    return total.astype(expert_out.dtype)

  def combine_vjp(self, d_out, expert_out, layout: NetworkLayout, topk_weights):
    (recv_d,), _ = self.rail_exchange((d_out.astype(expert_out.dtype),), layout.rail_src,
                                      layout.rail_counts)
    d_rows, d_w = self.host_backend.combine_vjp(self._stacked(recv_d), expert_out,
                                                layout.host_layout,
                                                self._stacked(layout.recv_weights))
    (picked,) = self._rail_back((self._blocks(d_w.astype(jnp.float32)),), layout)  # [T, Hn, K]
    # A slot's expert lives on one host: the other hosts' dots for it are zero.
    return d_rows, jnp.sum(picked, axis=1)
