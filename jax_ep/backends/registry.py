"""Backend selection: the backends a group can run on, which one it gets and why, and making it.

`BACKENDS` maps each name `jax_ep.Group(backend=...)` takes to its `BackendEntry`: `supports`
says why that backend cannot run a group here (None when it can), `create` makes the backend
object, with the transport whose buffers it uses (None where it needs none), and `memory` says
what a group of it allocates (for `jax_ep.memory_bytes`). The public API learns a backend's
limits and memory only through these. `backend='auto'`
takes the first of `AUTO_ORDER` that supports the group and says which and why through the
`jax_ep` logger, once per process for each distinct choice. The hosts a group spans decide its
transport: ranks on several hosts (real ones, or `virtual_hosts`) take the network transport.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable, Sequence

import jax

from jax_ep._native import ffi, own_stream
from jax_ep._native.limits import KernelLimits, cuda_violation, kernel_limits
from jax_ep.backends import transport as transport_lib
from jax_ep.backends import topology as topology_lib
from jax_ep.backends import cuda_ops, reference
from jax_ep.backends.base import Backend
from jax_ep.backends.cuda import LocalBackend, NetworkBackend, PeerBackend
from jax_ep.backends.options import OWN_STREAM, CommOptions
from jax_ep.backends.reference import ReferenceBackend
from jax_ep.config import EPConfig

_logger = logging.getLogger("jax_ep")


@dataclasses.dataclass(frozen=True)
class Request:
  """What a backend is made for: the group's configuration, its transports' settings
  (`options`) and where it runs."""
  mesh: jax.sharding.Mesh
  config: EPConfig
  options: CommOptions
  key: str  # the group's key in the job (`jax_ep.launch._distributed.next_group_key`)
  process_ids: list[int] | None  # the group's processes when not all of the job's
  low_latency: bool
  topology: topology_lib.Topology | None  # the hosts of a group on the network transport


@dataclasses.dataclass(frozen=True)
class BackendMemory:
  """What one rank of a group allocates besides its ops' outputs (bytes).

  Attributes:
    workspace_bytes: the ops' scratch (the one-rank layout's workspace, the reference's
      intermediate arrays).
    comm_buffer_bytes: the transport's buffers (peer or network), 0 where there are none.
    low_latency_buffer_bytes: the part of those that exists for the low-latency pair.
  """
  workspace_bytes: int
  comm_buffer_bytes: int = 0
  low_latency_buffer_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class BackendEntry:
  """One backend of the registry.

  Attributes:
    supports: `(mesh, config, options, hosts) -> why not`: why this backend cannot run the
      group here, None when it can (`hosts`: each process's host name, where known).
    create: makes the backend and its transport for a `Request` (the transport owns the
      group's native buffers; None where there are none).
    describe: `mesh -> why`: the reason `auto` gives when it takes this backend first.
    memory: `(config, *, low_latency, network, num_hosts) -> BackendMemory`: what a group of
      this backend allocates, on `num_hosts` hosts where `network`, with the low-latency
      buffers where `low_latency`; computed on any machine.
  """
  supports: Callable[[jax.sharding.Mesh, EPConfig, CommOptions, Sequence[str] | None],
                     str | None]
  create: Callable[[Request], tuple[Backend, transport_lib.Transport | None]]
  describe: Callable[[jax.sharding.Mesh], str]
  memory: Callable[..., BackendMemory]


def cuda_support(mesh, config: EPConfig, num_sms: int, *, process_index: int | None = None,
                 limits: KernelLimits | None = None, extension_built: bool | None = None,
                 hosts: Sequence[str] | None = None,
                 peer_access: bool | None = None) -> str | None:
  """Why the cuda backend cannot run this group here, or None when it can.

  The process models it runs: one rank; one process per device (CUDA IPC between processes,
  whether each sees every GPU or only its own, or several share one GPU under MPS); one process
  driving every device of the group (peer access), all on one host. The keyword arguments
  stand in for this process's facts (tests pass them; by default they are read from JAX and
  the extension): `hosts`, the host name of each process of the group; `peer_access`, whether
  a process driving several GPUs may access each from each.
  """
  devices = list(mesh.devices.flat)
  platforms = sorted({d.platform for d in devices})
  if platforms != ["gpu"]:
    return f"the mesh has {', '.join(platforms)} devices, the cuda kernels need CUDA GPUs"
  if extension_built is None:
    extension_built = ffi.extension() is not None
  if not extension_built:
    return ("the CUDA extension is not built in this installation (no nvcc at build time, or "
            "JAX_EP_ENABLE_CUDA=OFF)")
  if limits is None:
    limits = kernel_limits()
  violation = cuda_violation(config, limits, num_sms)
  if violation is not None:
    return violation
  if config.num_ranks == 1:
    return None
  why = transport_lib.not_one_group(config, mesh)
  if why is not None:
    return f"the peer transport joins one EP group: {why}"
  me = jax.process_index() if process_index is None else process_index
  local = sum(d.process_index == me for d in devices)
  if local not in (1, len(devices)):
    return (f"process {me} holds {local} of the group's {len(devices)} devices; the "
            f"peer transport runs one process per device or one process for all of them")
  if hosts is not None and len(set(hosts)) > 1:
    return (f"the group's processes run on {len(set(hosts))} hosts; the peer transport "
            f"joins the GPUs of one host")
  if local == len(devices):
    if peer_access is None:
      peer_access = bool(ffi.extension().peer_access(
          [d.local_hardware_id for d in devices]))
    if not peer_access:
      return "these GPUs cannot access each other's memory (no P2P between them)"
  return None


def _process_model(mesh) -> str:
  devices = list(mesh.devices.flat)
  if len(devices) == 1:
    return "one rank"
  if len({d.process_index for d in devices}) == 1:
    return f"one process driving {len(devices)} devices"
  return f"one process per device, {len(devices)} ranks"


def _reference_memory(config: EPConfig, *, low_latency: bool, network: bool,
                      num_hosts: int) -> BackendMemory:
  del low_latency, network, num_hosts  # no transport, no buffers of its own
  return BackendMemory(reference.scratch_bytes(config))


def _cuda_memory(config: EPConfig, *, low_latency: bool, network: bool,
                 num_hosts: int) -> BackendMemory:
  workspace = cuda_ops.layout_workspace_bytes(config) if config.num_ranks == 1 else 0
  comm = transport_lib.buffer_bytes(config, low_latency, network, num_hosts)
  low_latency_part = 0
  if low_latency:
    low_latency_part = comm - transport_lib.buffer_bytes(
        config, False, network and num_hosts >= 2, num_hosts)
    if config.num_ranks == 1:  # the one-rank group's buffer exists for the low-latency pair alone
      low_latency_part = comm
  return BackendMemory(workspace, comm, low_latency_part)


def _create_reference(request: Request):
  return ReferenceBackend(request.config), None


def _local_hardware_ids(mesh) -> list[int]:
  """The hardware ids of this process's devices of `mesh`. A compile-only device
  (jax.experimental.topologies: compiling ahead of time, with no GPU) has none, and nothing
  to load onto or make a stream on."""
  return [d.local_hardware_id for d in mesh.devices.flat
          if d.process_index == jax.process_index() and d.local_hardware_id is not None]


def _create_cuda(request: Request):
  """The cuda backend of the group's process model: a transport (the native groups and their
  buffers) wherever ranks talk to each other or the low-latency pair needs buffers, else the
  local kernels, loaded now rather than inside the first handler."""
  r, config, mesh = request, request.config, request.mesh
  if r.options.comm_stream == OWN_STREAM:
    # jax_ep's own stream and its events, made now rather than inside a handler.
    for device in _local_hardware_ids(mesh):
      own_stream.prepare(ffi.extension(), device, r.options.num_sms)
  if config.num_ranks == 1 and not r.low_latency:
    for device in _local_hardware_ids(mesh):
      ffi.extension().preload_kernels(device)
    return LocalBackend(config, None, r.options), None
  o = r.options
  if r.topology is not None and r.topology.num_hosts > 1:
    transport = transport_lib.create_network(
        config, mesh, r.key, num_sms=o.num_sms, timeout_s=o.timeout_s, topology=r.topology,
        low_latency=r.low_latency, exchange_timeout_s=o.config_timeout_s)
  else:
    transport = transport_lib.create_peer(config, mesh, r.key, num_sms=o.num_sms,
                                          timeout_s=o.timeout_s, process_ids=r.process_ids,
                                          low_latency=r.low_latency)
  ll_group = transport.primary_id if r.low_latency else None
  backend: Backend
  if isinstance(transport, transport_lib.NetworkTransport):
    backend = NetworkBackend(
        config, transport.primary_id, r.options, ll_group,
        host_group_id=transport.host_group_id,
        hosts=r.topology.hosts if transport.equal_hosts else ())
  elif config.num_ranks > 1:
    backend = PeerBackend(config, transport.primary_id, r.options, ll_group)
  else:  # one rank: local kernels, and the low-latency pair on the one-rank group
    backend = LocalBackend(config, ll_group, r.options)
  return backend, transport


BACKENDS: dict[str, BackendEntry] = {
    "reference": BackendEntry(supports=lambda mesh, config, options, hosts: None,
                              create=_create_reference,
                              describe=lambda mesh: "pure JAX, any platform",
                              memory=_reference_memory),
    # `cuda_support` looked up when called, so that tests can stand in for this machine's facts.
    "cuda": BackendEntry(
        supports=lambda mesh, config, options, hosts: cuda_support(
            mesh, config, options.num_sms, hosts=hosts),
        create=_create_cuda,
        describe=lambda mesh: f"CUDA GPUs, {_process_model(mesh)}",
        memory=_cuda_memory),
}
# What `backend='auto'` tries, best first; the last one supports every group.
AUTO_ORDER = ("cuda", "reference")


def check_name(backend) -> None:
  """A `ValueError` unless `backend` is 'auto' or a name of `BACKENDS`."""
  names = ("auto", *BACKENDS)
  if backend not in names:
    listed = ", ".join(map(repr, names[:-1])) + f" or {names[-1]!r}"
    raise ValueError(f"jax_ep.Group: backend must be {listed}; got {backend!r}")


_SAID: set[tuple[str, str]] = set()


def _say_choice(name: str, why: str, warn: bool) -> None:
  """Logs the backend `auto` chose and why, once per process for each distinct choice."""
  if (name, why) in _SAID:
    return
  _SAID.add((name, why))
  log = _logger.warning if warn else _logger.info
  log("jax_ep.Group(backend='auto'): %s backend (%s)", name, why)


def _resolve_backend(backend: str, mesh, config: EPConfig, options: CommOptions,
                     hosts: Sequence[str] | None = None) -> tuple[str, str]:
  """`(backend name, why)` for the requested backend ('auto' or a name of `BACKENDS`)."""
  if backend != "auto":
    why_not = BACKENDS[backend].supports(mesh, config, options, hosts)
    if why_not is not None:
      raise ValueError(f"jax_ep.Group: backend={backend!r} cannot run this group: {why_not}")
    return backend, "asked for"
  declined = []
  for name in AUTO_ORDER:
    why_not = BACKENDS[name].supports(mesh, config, options, hosts)
    if why_not is None:
      break
    declined.append(why_not)
  if not declined:
    why = BACKENDS[name].describe(mesh)
    _say_choice(name, why, warn=False)
    return name, why
  # A fallback says why the better backends cannot run the group; a warning where the mesh is
  # on GPUs (the user likely meant the kernels).
  why = "; ".join(declined)
  on_gpu = all(d.platform == "gpu" for d in mesh.devices.flat)
  _say_choice(name, why, warn=on_gpu)
  return name, why


def needs_hosts(backend: str, mesh, config: EPConfig, members: Sequence[int],
                virtual_hosts: int | None) -> bool:
  """Whether choosing the backend needs the host each process runs on: a multi-process GPU
  group that may take the cuda backend (the peer transport joins the GPUs of one host),
  or virtual hosts. Every member asks the same question, so all decide alike."""
  return ((backend != "reference" and config.num_ranks > 1 and len(members) > 1
           and all(d.platform == "gpu" for d in mesh.devices.flat))
          or (virtual_hosts or 1) > 1)


@dataclasses.dataclass(frozen=True)
class Selection:
  """The backend a group runs on (`name`, `why`) and, for the network transport, the map of
  its hosts (`topology`; None on one host)."""
  name: str
  why: str
  topology: topology_lib.Topology | None


def select(backend: str, mesh, config: EPConfig, options: CommOptions, *,
           members: Sequence[int], hosts: list[str] | None,
           virtual_hosts: int | None) -> Selection:
  """The backend `backend` ('auto' or a name) gives this group, and its transport's hosts.

  Args:
    members: the processes holding the mesh's devices, ascending.
    hosts: the host name of each member (None where `needs_hosts` said they are not needed).
    virtual_hosts: `jax_ep.Group`'s argument.
  """
  # Several real hosts: backend='cuda' takes the network transport ('auto' keeps the
  # reference there: the network path has not run on real NICs here).
  several_hosts = hosts is not None and len(set(hosts)) > 1
  network = (virtual_hosts or 1) > 1 or (several_hosts and backend == "cuda")
  if network and config.expert_alignment > 1:
    raise ValueError(
        f"jax_ep.Group: expert_alignment={config.expert_alignment} is not implemented on the "
        f"cuda backend's network transport (virtual_hosts, or processes on several hosts): "
        f"its high-throughput ops (jax_ep/backends/hierarchical.py) lay out each expert's "
        f"rows as one group per source host; pass expert_alignment=1 there, or "
        f"backend='reference'")
  if network and several_hosts:
    from jax_ep.backends import nvshmem
    try:
      nvshmem.load()
    except nvshmem.NvshmemUnavailable as e:
      raise ValueError(f"jax_ep.Group: this group's processes run on {len(set(hosts))} hosts, "
                       f"which takes the network transport: {e}") from None
  name, why = _resolve_backend(backend, mesh, config, options, None if network else hosts)
  topology = None
  if network:
    if name != "cuda":
      raise ValueError(f"jax_ep.Group: the network transport (virtual_hosts, or several "
                       f"hosts) needs the cuda backend, which cannot run this group here: "
                       f"{why}")
    host_of_process = dict(zip(members, hosts or [socket.gethostname()] * len(members)))
    topology = topology_lib.discover(
        [host_of_process[d.process_index] for d in mesh.devices.flat],
        virtual_hosts=virtual_hosts)
  return Selection(name, why, topology)


def create(name: str, request: Request) -> tuple[Backend, transport_lib.Transport | None]:
  """The backend `name` for `request`, and the transport it uses (None where it has none)."""
  return BACKENDS[name].create(request)
