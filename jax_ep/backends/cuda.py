"""The cuda backend: the kernels through XLA FFI custom calls (jax_ep/backends/cuda_ops.py).

One class per transport of a group: `LocalBackend` at one rank (local kernels), `PeerBackend`
over the peer transport (one NVLink domain), `NetworkBackend` across hosts (the network
transport, and the hierarchy of jax_ep/backends/hierarchical.py for the high-throughput ops). The
registry (jax_ep/backends/registry.py) makes the one a group runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_ep._native import effects, ffi
from jax_ep.backends import cuda_ops, hierarchical
from jax_ep.backends.base import Backend, HighThroughputBackend, LayoutThenDispatch
from jax_ep.backends.options import CommOptions, Stream
from jax_ep.config import EPConfig


def _raise_on_failure(status, group_id: int) -> None:
  """The debug mode (`raise_on_timeout=True`): a host check of an group op's `status` right
  after it, raising `TimeoutError` with the group's error record."""
  def raise_if_failed(value):
    if value != 0:
      message = ffi.extension().group_error(group_id)
      effects.note_failure()
      raise TimeoutError(message or f"jax_ep: group op failed with status {int(value)}")
  # NOTES: a debug callback, not an io_callback: its effect is allowed under `jax.checkpoint`
  # (a layer stack under scan + remat), and a check that runs twice when the forward pass is
  # recomputed is harmless.
  jax.debug.callback(raise_if_failed, status)


class _CudaLowLatency:
  """The low-latency pair through its kernels (jax_ep/backends/cuda_ops.py,
  ffi/kernels/low_latency_*.cu), on the native group `ll_group_id` (a group created with
  `low_latency=True`)."""
  config: EPConfig
  ll_group_id: int | None
  options: CommOptions

  low_latency_kernels = True

  def _ll_group(self, op: str) -> int:
    if self.ll_group_id is None:
      raise ValueError(f"jax_ep.{op}: this cuda group has no low-latency buffers; create the "
                       f"jax_ep.Group with low_latency=True (jax_ep.memory_bytes(..., "
                       f"low_latency=True) reports their size)")
    return self.ll_group_id

  def _ll_checked(self, status):
    if self.options.raise_on_timeout:
      _raise_on_failure(status, self.ll_group_id)

  def low_latency_dispatch(self, x, topk_idx, row_format, topk_weights=None):
    gid = self._ll_group("low_latency_dispatch")
    recv_x, scales, count, num_invalid, layout, status = cuda_ops.low_latency_dispatch(
        self.config, gid, x, topk_idx, row_format, topk_weights)
    self._ll_checked(status)
    # Slots naming one expert are merged, so a (source, expert) region never overflows.
    return recv_x, scales, count, jnp.zeros((), jnp.int32), num_invalid, layout

  def low_latency_combine(self, expert_out, layout, topk_weights, gather=False):
    out, status = cuda_ops.low_latency_combine(
        self.config, self._ll_group("low_latency_combine"), expert_out, layout, topk_weights,
        gather)
    self._ll_checked(status)
    return out

  def low_latency_dispatch_send(self, x, topk_idx, row_format):
    return cuda_ops.low_latency_dispatch_send(
        self.config, self._ll_group("low_latency_dispatch_send"), x, topk_idx, row_format)

  def low_latency_dispatch_wait(self, sent, topk_idx, x_dtype, row_format):
    recv_x, scales, count, layout, status = cuda_ops.low_latency_dispatch_wait(
        self.config, self._ll_group("low_latency_dispatch_wait"), sent, topk_idx, x_dtype,
        row_format)
    self._ll_checked(status)
    return recv_x, scales, count, jnp.zeros((), jnp.int32), sent, layout

  def low_latency_combine_send(self, expert_out, layout):
    return cuda_ops.low_latency_combine_send(
        self.config, self._ll_group("low_latency_combine_send"), expert_out, layout)

  def low_latency_combine_wait(self, sent, layout, topk_weights, dtype):
    out, status = cuda_ops.low_latency_combine_wait(
        self.config, self._ll_group("low_latency_combine_wait"), sent, layout, topk_weights,
        dtype)
    self._ll_checked(status)
    return out


@dataclasses.dataclass(frozen=True)
class LocalBackend(_CudaLowLatency, LayoutThenDispatch, Backend):
  """CUDA kernels through XLA FFI custom calls, at one rank (`R == 1`).

  Dispatch and combine are purely local there (local_layout, local_dispatch, local_combine);
  `R > 1` uses `PeerBackend`. The low-latency pair runs its kernels on a one-rank
  native group (`ll_group_id`, where the group was created with `low_latency=True`): its
  rows never leave this GPU.
  """
  config: EPConfig
  ll_group_id: int | None = None
  options: CommOptions = CommOptions()
  name = "cuda"

  def layout(self, topk_idx):
    return cuda_ops.local_layout(self.config, topk_idx, stream=self.options.stream)

  def dispatch_cached(self, x, layout, topk_weights=None):
    return cuda_ops.local_dispatch(self.config, x, layout, topk_weights,
                                   stream=self.options.stream)

  def dispatch_fp8(self, x, x_scales, topk_idx, topk_weights):
    del topk_weights  # travels with the handle, as in `dispatch`
    layout, group_sizes, num_dropped, num_invalid = self.layout(topk_idx)
    recv_x, recv_scales = cuda_ops.local_dispatch_fp8(self.config, x, x_scales, layout,
                                                      stream=self.options.stream)
    return recv_x, recv_scales, group_sizes, num_dropped, num_invalid, layout

  def combine(self, expert_out, layout, topk_weights=None):
    return cuda_ops.local_combine(self.config, expert_out, layout, topk_weights,
                                  stream=self.options.stream)

  def combine_vjp(self, d_out, expert_out, layout, topk_weights):
    stream = self.options.stream
    d_expert_out = cuda_ops.local_dispatch(self.config, d_out, layout, topk_weights,
                                           stream=stream)
    return d_expert_out, cuda_ops.local_combine_vjp(self.config, d_out, expert_out, layout,
                                                    stream=stream)


@dataclasses.dataclass(frozen=True)
class PeerBackend(_CudaLowLatency, Backend):
  """CUDA kernels over peer memory for `R > 1` in one NVLink domain (the peer transport,
  jax_ep/backends/transport.py).

  Attributes:
    config: the group configuration.
    group_id: the native group the handlers look up (the primary one of this process).
    options: the group's `CommOptions`. With `raise_on_timeout` (debug mode) each op's status
      is checked on the host right after it (a `jax.debug.callback`, i.e. one host
      synchronisation per op), raising `TimeoutError` naming op, rank and peer (surfacing
      wrapped in JAX's runtime error). Off by default: a timeout then reaches the host through
      the group's error record (jax_ep/_status.py).
  """
  config: EPConfig
  group_id: int
  options: CommOptions = CommOptions()
  ll_group_id: int | None = None
  name = "cuda"

  def _checked(self, status):
    if self.options.raise_on_timeout:
      _raise_on_failure(status, self.group_id)

  def dispatch(self, x, topk_idx, topk_weights):
    *outs, status = cuda_ops.peer_dispatch(self.config, self.group_id, x, topk_idx,
                                           topk_weights, stream=self.options.stream)
    self._checked(status)
    return tuple(outs)

  def dispatch_fp8(self, x, x_scales, topk_idx, topk_weights):
    *outs, status = cuda_ops.peer_dispatch_fp8(self.config, self.group_id, x, x_scales,
                                               topk_idx, topk_weights,
                                               stream=self.options.stream)
    self._checked(status)
    return tuple(outs)

  def dispatch_cached(self, x, layout, topk_weights=None):
    # The weights of a weighted dispatch are the ones that travelled with the dispatch.
    recv_x, status = cuda_ops.peer_dispatch_cached(self.config, self.group_id, x, layout,
                                                   weighted=topk_weights is not None,
                                                   stream=self.options.stream)
    self._checked(status)
    return recv_x

  def combine(self, expert_out, layout, topk_weights=None):
    out, status = cuda_ops.peer_combine(self.config, self.group_id, expert_out, layout,
                                        weighted=topk_weights is not None,
                                        stream=self.options.stream)
    self._checked(status)
    return out

  def combine_vjp(self, d_out, expert_out, layout, topk_weights):
    d_expert_out, d_topk_weights, status = cuda_ops.peer_combine_vjp(
        self.config, self.group_id, d_out, expert_out, layout, stream=self.options.stream)
    self._checked(status)
    return d_expert_out, d_topk_weights


@dataclasses.dataclass(frozen=True)
class _RankTable:
  """`table[axis_index(axis_name)]`: a per-rank constant looked up inside the per-shard
  function (hashable, so that a backend holding it can be a custom_vjp's static argument)."""
  axis_name: str
  table: tuple

  def __call__(self):
    return jnp.asarray(self.table, jnp.int32)[jax.lax.axis_index(self.axis_name)]


@dataclasses.dataclass(frozen=True)
class _CudaRailExchange:
  """The rail exchange's kernels (`hierarchical.reference_rail_exchange`'s signature) on the
  network group `group_id`; `pes()` is this rank's rail peer on each host."""
  config: EPConfig
  group_id: int
  num_hosts: int
  pes: _RankTable
  options: CommOptions = CommOptions()

  def __call__(self, sources, index, counts):
    received, recv_counts, status = cuda_ops.rail_exchange(
        self.config, self.group_id, self.num_hosts, sources, index, counts, self.pes(),
        stream=self.options.stream)
    if self.options.raise_on_timeout:
      _raise_on_failure(status, self.group_id)
    return received, recv_counts


@dataclasses.dataclass(frozen=True)
class _CudaQuantize:
  """The fp8 rows of `x` `[T, H]` in `config.wire_format`, rounded by the kernels
  (`cuda_ops.fp8_quantize`): what the rail exchange sends of an fp8 dispatch."""
  config: EPConfig
  stream: Stream = None

  def __call__(self, x):
    return cuda_ops.fp8_quantize(self.config, x, stream=self.stream)


@dataclasses.dataclass(frozen=True)
class NetworkBackend(_CudaLowLatency, Backend):
  """A cuda group whose ranks span several hosts (real, or virtual ones on one machine).

  The low-latency pair runs its kernels on the group itself, with the network transport
  (NVSHMEM puts) for the ranks on other hosts. The high-throughput ops cross hosts once per
  token and host (jax_ep/backends/hierarchical.py): the rail exchange on this group, then the
  host's own group (`host_group_id`, the peer transport; None on a host of one rank, which uses
  the local kernels).

  It composes the other backends rather than extending one: the high-throughput ops are a
  `hierarchical.Hierarchy` of the rail exchange on this group and the host's own backend
  (`PeerBackend`, or `LocalBackend` on a host of one rank).

  Attributes:
    config: the group configuration.
    group_id: the network group the low-latency pair and the rail exchange run on.
    options: as `PeerBackend`'s.
    ll_group_id: the group of the low-latency pair (`group_id` where the group has the
      low-latency buffers, else None).
    host_group_id: this host's own group (the peer transport), None on a host of one rank.
    hosts: the ranks of each host (`Topology.hosts`); empty where the hosts hold different
      numbers of ranks (no rail pairs them), where the high-throughput ops raise.
  """
  config: EPConfig
  group_id: int
  options: CommOptions = CommOptions()
  ll_group_id: int | None = None
  host_group_id: int | None = None
  hosts: tuple = ()
  name = "cuda"

  def _hierarchy(self, op: str) -> hierarchical.Hierarchy:
    if not self.hosts:
      raise NotImplementedError(
          f"jax_ep.{op}: this group's hosts hold different numbers of its ranks, or ranks not "
          f"contiguous in rank order; the high-throughput ops across hosts pair each rank with "
          f"the rank of the same local index on every other host, which needs hosts of equal "
          f"size, host h holding ranks h * G to h * G + G - 1 (the low-latency ops run on any "
          f"hosts; backend='reference' runs every op)")
    c = self.config
    num_hosts = len(self.hosts)
    host_cfg = hierarchical.host_config(c, num_hosts)
    host_backend: HighThroughputBackend
    if self.host_group_id is None:
      host_backend = LocalBackend(host_cfg, None, self.options)
    else:
      host_backend = PeerBackend(host_cfg, self.host_group_id, self.options)
    host_of, pes = [0] * c.num_ranks, [()] * c.num_ranks
    for h, ranks in enumerate(self.hosts):
      for g, rank in enumerate(ranks):
        host_of[rank] = h
        pes[rank] = tuple(other[g] for other in self.hosts)
    rail_exchange = _CudaRailExchange(c, self.group_id, num_hosts,
                                      _RankTable(c.axis_name, tuple(pes)), self.options)
    return hierarchical.Hierarchy(c, self.hosts, host_backend, rail_exchange,
                                  _RankTable(c.axis_name, tuple(host_of)),
                                  _CudaQuantize(host_cfg, self.options.stream))

  def dispatch(self, x, topk_idx, topk_weights):
    return self._hierarchy("dispatch").dispatch(x, topk_idx, topk_weights)

  def dispatch_fp8(self, x, x_scales, topk_idx, topk_weights):
    return self._hierarchy("dispatch").dispatch_fp8(x, x_scales, topk_idx, topk_weights)

  def dispatch_cached(self, x, layout, topk_weights=None):
    return self._hierarchy("dispatch").dispatch_cached(x, layout, topk_weights)

  def combine(self, expert_out, layout, topk_weights=None):
    return self._hierarchy("combine").combine(expert_out, layout, topk_weights)

  def combine_vjp(self, d_out, expert_out, layout, topk_weights):
    return self._hierarchy("combine").combine_vjp(d_out, expert_out, layout, topk_weights)
