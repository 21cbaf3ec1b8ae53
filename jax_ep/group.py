"""`Group`: one expert-parallel communicator over a mesh axis.

Creating a group checks its arguments, agrees on its configuration with the other processes,
has jax_ep/backends/registry.py choose and make its backend (and the transport that owns its
buffers), and watches for run-time failures (jax_ep/_status.py); the sizes of its buffers
come from jax_ep/sizing.py.
"""

from __future__ import annotations

import logging
import socket

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _status
from jax_ep._native import effects
from jax_ep.backends import registry
from jax_ep.backends.options import CommOptions
from jax_ep.backends.transport import NetworkTransport, Transport
from jax_ep.config import RowFormat, as_row_format, positive_int
from jax_ep.launch import _distributed
# Re-exported: `from jax_ep.group import memory_bytes, MemoryEstimate` is how code imports them.
from jax_ep.sizing import MemoryEstimate, memory_bytes, resolve_capacity  # noqa: F401
from jax_ep.sizing import check_configuration, refuse_capacity_factor

_logger = logging.getLogger("jax_ep")


# Transports of groups not yet closed: the exit hook of jax_ep/_native/effects.py
# settles JAX's effect tokens when one of them recorded a timeout (strong references: a dropped
# group's native buffers and error record live on until exit anyway).
_OPEN_TRANSPORTS: dict[int, Transport] = {}
effects.add_failure_source(
    lambda: any(t.error() for t in list(_OPEN_TRANSPORTS.values())))


class Group:
  """An expert-parallel group over one mesh axis.

  Created once per MoE configuration (outside `jit`); the ops `dispatch`, `combine`,
  `low_latency_dispatch` and `low_latency_combine` take it as their first argument and must be
  called inside `jax.shard_map` over `axis_name`. When several processes form the mesh (through
  `jax.distributed`), creating a group checks that every process passed the same configuration
  and raises a `ValueError` naming the first field that differs.

  Args:
    mesh: a `jax.sharding.Mesh` that has `axis_name`.
    axis_name: the mesh axis experts are sharded over; its size is `R`.
    num_experts: `E`, global expert count, divisible by `R`.
    num_topk: `K`, experts per token.
    hidden: `H`.
    max_tokens_per_rank: `T_max`, the most tokens one rank passes per call.
    dtype: activation dtype (bfloat16, float16 or float32).
    capacity: rows of the dispatch output per rank, positive; default `R * T_max * min(K, E/R)`
      (plus `expert_alignment`'s padding), the exact worst case (a token's slots that name one
      expert share one row, so a token brings at most `min(K, L)` rows to a rank): the default
      never drops. Smaller values save memory (`memory_bytes()`, docs/memory.md); the excess
      is counted in `num_dropped` and contributes zero to combine, and `strict` makes it an
      error.
    buffer_factor: the alternative to `capacity` (pass at most one): a positive finite `f`
      giving `ceil(f * T_max * K)` rows, `f` times what a rank receives when routing is
      perfectly balanced (plus `expert_alignment`'s padding), rounded up to a multiple of the
      grouped GEMM's row tile (`jax_ep.gmm.ROW_TILE`) and clamped to the worst case above,
      which no rank can exceed (`jax_ep.capacity_from_buffer_factor`). `group.capacity` is
      the rows it gave, `group.buffer_factor` the factor (None when not given). Drops are
      counted and `strict` raises exactly as with `capacity`. Not MaxText's or GShard's
      `capacity_factor` (a cap per expert and sequence: `jax_ep.limit_expert_capacity`).
    expert_alignment: `A`, a positive int (default 1): each local expert's rows in the
      dispatch output start at a multiple of `A` (`DispatchResult.group_offsets` says where),
      so that a grouped GEMM's row tile of `A` rows never holds two experts' rows. The rows
      between one expert's last row and the next expert's first are padding, unspecified like
      the rows past the groups. The default capacity and `buffer_factor`'s rows grow by the
      most padding it can add, `L * (A - 1)` rows; a `capacity` given in rows is taken as it
      is (a row that does not fit with the padding is dropped and counted). Not on the cuda
      backend's network transport (`virtual_hosts`, several hosts).
    backend: 'auto' (default): cuda wherever it can run this group (CUDA GPUs with the
      extension built, a configuration inside the kernels' limits, one rank or a process model
      the peer transport runs: one process per device, or one process for all of them), else
      the reference; the choice and its reason go to the `jax_ep` logger once and stay in
      `backend_name` / `backend_reason`. 'reference' or 'cuda' force one ('cuda' raises a
      `ValueError` saying why where it cannot run).
    strict: make any dropped row an error. Every dispatch reports its drops to the host (a
      host callback per dispatch in this mode: a debug setting); a drop is logged at once, the
      dispatch completes with it counted in `num_dropped`, and `check()`, `close()` and the
      next op traced on the group raise `jax_ep.CapacityOverflowError` naming the shards, the
      rows dropped and the capacity that would fit them (call `check()` in a loop over a
      compiled step: it does not synchronise the device).
    config_timeout_s: how long group creation waits for peer processes' configurations.
    num_sms: multiprocessors' worth of the blocks that send to peers, 1 to 1024 (bounded grid:
      each send kernel sends from `num_sms` times the blocks one SM holds of it, 512 to 1024
      threads). Work that stays on this GPU runs on the other SMs in the same kernel, while the
      rows travel: the dispatch's placement of rows (its permute; the other ranks' rows too
      where every rank has a GPU of its own) and the combine's partial sums of this rank's own
      tokens. With `comm_stream="jax_ep"` that local work and every other grid of an op sized
      by the GPU's SMs (the one-rank kernels too) take `num_sms` SMs' worth instead.
    timeout_s: how long a multi-rank kernel waits for a peer before it gives up. It must cover
      the start-up skew between processes (one still compiling while another already waits in
      its first op). A timeout never hangs and never needs a host synchronisation to be seen:
      the kernels stop waiting, leave their outputs defined and write an error record into
      host-mapped memory; a watchdog thread logs it (op, rank, peer, call) through the
      `jax_ep` logger at once; every later op of the group fails with that text, and
      `check()`, `close()` and the next op traced on the group raise `TimeoutError` with it.
    raise_on_timeout: debug mode: after each multi-rank op, check its status on the host and
      raise `TimeoutError` right there (a host callback, one host synchronisation per op).
      Default False.
    low_latency: allocate the low-latency buffers (cuda backend): the kernels of
      `low_latency_dispatch` / `low_latency_combine` need them. Two sets of `L * R * T_max`
      rows per rank (`memory_bytes(..., low_latency=True).low_latency_buffer_bytes`), so
      off by default; the reference backend needs none.
    virtual_hosts: split the ranks (of one host) into this many hosts of equal size, contiguous
      in rank order, whose traffic between them takes the network transport (NVSHMEM puts)
      instead of the peer transport: the emulation of a multi-host job on one machine, for
      tests and benchmarks (docs/multihost.md). cuda backend, one process per device (rank r
      on process r); both modes run on it, the high-throughput ops crossing hosts once per
      token and host (jax_ep/backends/hierarchical.py). Default None (the real hosts). A group
      whose processes run on several real hosts takes the same network transport when created
      with `backend='cuda'` (NVSHMEM installed and jax_ep built with it); `backend='auto'`
      gives such a group the reference backend.
    wire_format: how `dispatch` sends and returns its rows (`jax_ep.RowFormat`, or a member's
      value or name as a string; default PLAIN: the activations' dtype, as ever). An fp8
      member (FP8, FP8_POW2_SCALES, FP8_UE8M0, as the low-latency `row_format`) quantises
      each token once, on its own rank, per 128 channels to float8_e4m3fn with
      `scale = amax / 448` (the low-latency dispatch's rounding), sends those bytes and the
      scales, and returns `recv.x` `[capacity, H]` float8_e4m3fn with `recv.scales`
      `[capacity, H/128]` float32 (`[capacity, H/512]` int32 UE8M0 exponents with FP8_UE8M0);
      needs `H % 128 == 0` (`H % 512` with FP8_UE8M0). Combine stays in `dtype`. Both
      backends run it, the cuda backend's kernels with the same rounding, bit for bit, at one
      rank, over the peer transport and across hosts (docs/api.md, "FP8 dispatch").
    comm_stream: the GPU stream of the cuda backend's high-throughput ops (dispatch, combine,
      their backward ops; the rail exchange across hosts): None (default) runs them on XLA's
      compute stream, in line with the other kernels; `"jax_ep"` on jax_ep's own stream, each
      op launched there once the work queued before it is done and joined where the layer's
      pipeline puts the join: `moe_mlp(..., micro_batches=2)` then runs one micro-batch's
      dispatch and combine beside another's experts, forward and backward; an int N from 1 to
      8 on XLA's additional stream N (each op's custom call annotated for it), XLA starting
      each op once the work queued before it is done and making its consumers wait for it
      (docs/api.md, "Communication beside the experts"). Each op leaves the command buffer
      (CUDA graph) it would sit in. The low-latency pair stays on the compute stream (a decode
      step lives in command buffers), as do the reference backend's ops (XLA's own).
    capacity_factor: not taken: a `TypeError` says which of `buffer_factor` (this rank's
      receive buffer, MaxText's `ragged_buffer_factor`) and `jax_ep.limit_expert_capacity`
      (each expert's slots per sequence, MaxText's and GShard's `capacity_factor`) a config
      that names it means.
  """

  def __init__(self, mesh, axis_name: str, *, num_experts: int, num_topk: int, hidden: int,
               max_tokens_per_rank: int, dtype=jnp.bfloat16, capacity: int | None = None,
               buffer_factor: float | None = None, backend: str = "auto", strict: bool = False,
               config_timeout_s: float = 60.0, num_sms: int = 24, timeout_s: float = 60.0,
               raise_on_timeout: bool = False, low_latency: bool = False,
               virtual_hosts: int | None = None, expert_alignment: int = 1,
               wire_format: RowFormat | str | None = None, comm_stream: int | str | None = None,
               capacity_factor: None = None):
    if axis_name not in mesh.axis_names:
      raise ValueError(f"jax_ep.Group: axis_name {axis_name!r} is not an axis of the mesh "
                       f"(mesh axes: {tuple(mesh.axis_names)})")
    refuse_capacity_factor(capacity_factor, "jax_ep.Group")
    registry.check_name(backend)
    num_ranks = int(mesh.shape[axis_name])
    config = check_configuration(
        "jax_ep.Group", axis_name, num_ranks=num_ranks, num_experts=num_experts,
        num_topk=num_topk, hidden=hidden, max_tokens_per_rank=max_tokens_per_rank, dtype=dtype,
        capacity=capacity, buffer_factor=buffer_factor, expert_alignment=expert_alignment,
        strict=strict, ranks=f"the size of mesh axis {axis_name!r} ({num_ranks} ranks)",
        wire_format=wire_format)
    options = CommOptions.checked(num_sms=num_sms, timeout_s=timeout_s,
                                  config_timeout_s=config_timeout_s,
                                  raise_on_timeout=raise_on_timeout, comm_stream=comm_stream)
    if virtual_hosts is not None:
      virtual_hosts = positive_int("virtual_hosts", virtual_hosts)
      if num_ranks % virtual_hosts:
        raise ValueError(f"jax_ep.Group: virtual_hosts={virtual_hosts} must divide the "
                         f"{num_ranks} ranks of mesh axis {axis_name!r}")
      if virtual_hosts > 1 and backend == "reference":
        raise ValueError("jax_ep.Group: virtual_hosts emulates the cuda backend's network "
                         "transport; backend='reference' has no transports")
    self.mesh = mesh
    self.config = config
    self.options = options
    # The processes holding the mesh's devices create the group together; a group over some of
    # the job's processes is checked and counted among them alone.
    members = sorted({d.process_index for d in mesh.devices.flat})
    if jax.process_index() not in members:
      raise ValueError(
          f"jax_ep.Group: process {jax.process_index()} holds none of the mesh's devices (they "
          f"belong to processes {members}); create the group only on those processes")
    subset = members if len(members) < jax.process_count() else None
    key = _distributed.next_group_key("group", subset)
    self._key = key  # its handles carry it: a combine tells its own from another group's
    hosts = None
    if registry.needs_hosts(backend, mesh, self.config, members, virtual_hosts):
      hosts = _distributed.gather_values(f"{key}/hosts", socket.gethostname(),
                                         process_ids=members, timeout_s=options.config_timeout_s)
    selection = registry.select(backend, mesh, self.config, options, members=members,
                                hosts=hosts, virtual_hosts=virtual_hosts)
    self.backend_name, self.backend_reason = selection.name, selection.why
    if options.comm_stream is not None and self.backend_name != "cuda":
      _logger.info("jax_ep.Group: comm_stream=%r has no effect on the %s backend's ops (XLA's "
                   "own, scheduled by XLA)", options.comm_stream, self.backend_name)
    self.topology = selection.topology
    fields = dict(self.config.fingerprint(), backend=self.backend_name,
                  low_latency=bool(low_latency), virtual_hosts=virtual_hosts or 1)
    self.low_latency = bool(low_latency)
    _distributed.check_same_config(key, fields, timeout_s=options.config_timeout_s,
                                   process_ids=subset)
    self._closed = False
    self.backend, self._transport = registry.create(self.backend_name, registry.Request(
        mesh, self.config, options, key, process_ids=subset, low_latency=self.low_latency,
        topology=self.topology))
    if self._transport is not None:
      _OPEN_TRANSPORTS[id(self._transport)] = self._transport
      self._status = _status.GroupStatus(repr(self), poll=self._transport.error)
      _status.WATCHDOG.watch(self._status)
    else:
      self._status = _status.GroupStatus(repr(self))

  # Shorthands for the configuration.
  axis_name = property(lambda self: self.config.axis_name)
  num_ranks = property(lambda self: self.config.num_ranks)
  num_experts = property(lambda self: self.config.num_experts)
  num_local_experts = property(lambda self: self.config.num_local_experts)
  num_topk = property(lambda self: self.config.num_topk)
  hidden = property(lambda self: self.config.hidden)
  max_tokens_per_rank = property(lambda self: self.config.max_tokens_per_rank)
  dtype = property(lambda self: self.config.dtype)
  capacity = property(lambda self: self.config.capacity)
  buffer_factor = property(lambda self: self.config.buffer_factor)
  strict = property(lambda self: self.config.strict)
  expert_alignment = property(lambda self: self.config.expert_alignment)
  wire_format = property(lambda self: self.config.wire_format)

  @property
  def receives_while_sending(self) -> bool:
    """Whether dispatch places the other ranks' rows into `recv.x` as they land, in the kernel
    that sends (cuda peer transport, every rank on a GPU of its own with native P2P atomics
    between them). False elsewhere: the rows are then placed after the last one arrived (one
    GPU shared under MPS, GPUs without P2P atomics), or no transport is involved (reference
    backend, one rank). A performance property only; results are the same."""
    return (self._transport is not None and not self._transport.closed
            and self._transport.receives_while_sending)

  @property
  def network_ranks(self) -> tuple[int, ...]:
    """The ranks this process reaches through the network transport (NVSHMEM puts): those on
    other hosts (real ones, or `virtual_hosts`); empty for a group on one host."""
    if isinstance(self._transport, NetworkTransport):
      return self._transport.network_ranks
    return ()

  @property
  def combine_partial_dtype(self) -> np.dtype:
    """The dtype combine's per-(token, rank) partial sums travel home in.

    float32 (exact-first: the home rank adds fp32 partials and rounds once) except on the cuda
    peer transport with bfloat16 activations, where partials travel in bfloat16 (half of
    combine's wire bytes, as DeepEP does). Each bf16 partial `p` is rounded once on the expert
    side, so the result may differ from the fp32-partial sum by up to `2^-8 * sum_r |p_r|`
    per element, on top of the final rounding (docs/decisions.md). The same holds for the
    gradient of `dispatch` with respect to `x`, which is an unweighted combine.

    Across hosts (`combine_partial_roundings` == 2) each host's sum of its ranks' partials is
    rounded once more, to the activations' dtype, before it travels home: up to twice that
    bound (`2^-7 * sum_r |p_r|` for bf16), and for f16 activations one f16 rounding.
    """
    if self.combine_partial_roundings == 2:
      return np.dtype(self.dtype)
    if (self.backend_name == "cuda" and self.num_ranks > 1
        and self.dtype == np.dtype(jnp.bfloat16)):
      return np.dtype(jnp.bfloat16)
    return np.dtype(np.float32)

  @property
  def combine_partial_roundings(self) -> int:
    """How many times combine rounds a partial sum to `combine_partial_dtype` on its way home:
    2 on a group over several hosts (per (token, rank), then per (token, host)), else 1."""
    if self.topology is not None and self.topology.num_hosts > 1:
      return 2
    return 1

  def memory_bytes(self, row_format: RowFormat | str | None = None, *, ffn: int | None = None,
                   activation: str = "swiglu", fp8: bool = False) -> MemoryEstimate:
    """`jax_ep.memory_bytes` for this group (its capacity, backend and transports), the
    low-latency output in `row_format` (default PLAIN); `ffn`, `activation` and `fp8` also
    size what its expert layer keeps for the backward."""
    row_format = (RowFormat.PLAIN if row_format is None
                  else as_row_format(row_format, "jax_ep.Group.memory_bytes"))
    c = self.config
    return memory_bytes(num_ranks=c.num_ranks, num_experts=c.num_experts, num_topk=c.num_topk,
                        hidden=c.hidden, max_tokens_per_rank=c.max_tokens_per_rank,
                        dtype=c.dtype, capacity=c.capacity,
                        expert_alignment=c.expert_alignment, backend=self.backend_name,
                        row_format=row_format, wire_format=c.wire_format,
                        low_latency=self.low_latency,
                        network=isinstance(self._transport, NetworkTransport),
                        num_hosts=self.topology.num_hosts if self.topology else 0,
                        ffn=ffn, activation=activation, fp8=fp8)

  def constrain(self, value, spec):
    """Lays `value` out as `spec` over the group's mesh, inside or outside `jit`.

    Uses `jax.reshard` on meshes whose axes are Explicit (the default of `jax.make_mesh`) and
    `with_sharding_constraint` on Auto axes, so `shard_map(in_specs=spec)` accepts the result.
    """
    from jax.sharding import AxisType, NamedSharding
    sharding = NamedSharding(self.mesh, spec)
    if all(t == AxisType.Explicit for t in self.mesh.axis_types):
      return jax.reshard(value, sharding)
    return jax.lax.with_sharding_constraint(value, sharding)

  @property
  def closed(self) -> bool:
    return self._closed

  def check(self) -> None:
    """Raises the group's first run-time failure, if it had one.

    `TimeoutError` when a multi-rank op gave up waiting for a peer (the message names op, rank,
    peer and call); `jax_ep.CapacityOverflowError` when a strict group dropped rows. Reads the
    host-visible error record the kernels fill in; it does not synchronise the device, so call
    it after the results you care about are ready.
    """
    self._status.raise_if_failed()

  def close(self) -> None:
    """Releases the group's resources (after every process is done with the shared buffers);
    ops called with a closed group raise.

    Raises the group's run-time failure (see `check`) after releasing them, unless `check()` or
    an op already raised it to the caller.
    """
    if self._closed:
      return
    self._closed = True
    self._status.poll()
    self._status.close()
    _status.WATCHDOG.unwatch(self._status)
    if self._transport is not None:
      _OPEN_TRANSPORTS.pop(id(self._transport), None)
      late = self._transport.close()  # after the device finished: a late timeout counts
      if late:
        self._status.record(late)
    failure = self._status.failure()
    if self._transport is not None and (failure is not None or effects.any_failure()):
      effects.settle()  # see jax_ep/_native/effects.py
    # In the debug mode every op raised its own timeout already.
    seen = self._status.raised or (self.options.raise_on_timeout and failure is not None
                                   and failure[1] is TimeoutError)
    if failure is not None and not seen:
      message, error_type = failure
      raise error_type(message)

  def __enter__(self):
    return self

  def __exit__(self, exc_type, exc, tb):
    try:
      self.close()
    except Exception as error:  # noqa: BLE001 - the block's own exception goes first
      if exc_type is None:
        raise
      _logger.error("jax_ep.Group: closing after an exception: %s", error)

  def __repr__(self):
    c = self.config
    factor = "" if c.buffer_factor is None else f", buffer_factor={c.buffer_factor!r}"
    if c.expert_alignment != 1:
      factor += f", expert_alignment={c.expert_alignment}"
    if c.wire_format.is_fp8:
      factor += f", wire_format={c.wire_format}"
    return (f"jax_ep.Group(axis={c.axis_name!r}, ranks={c.num_ranks}, experts={c.num_experts}, "
            f"topk={c.num_topk}, hidden={c.hidden}, max_tokens_per_rank={c.max_tokens_per_rank}, "
            f"dtype={c.dtype}, capacity={c.capacity}{factor}, backend={self.backend_name!r})")
