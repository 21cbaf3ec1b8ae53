"""The cuda backend's transports: the native groups (ffi/runtime/) a `jax_ep.Group` owns, their
library-owned buffers and how the ranks reach each other's.

- the peer transport (`create_peer`, `PeerTransport`): the ranks of one NVLink domain, through a
  table of peer pointers. With one process per device (GPUs of one host, or several processes
  sharing one GPU under CUDA MPS) each process publishes the CUDA IPC handle of its buffer
  through the `jax.distributed` key-value store and opens its peers'. One process driving all
  devices uses the pointers directly (peer access). A one-rank group with the low-latency
  buffers is a peer transport of one rank.
- the network transport (`create_network`, `NetworkTransport`): ranks on several hosts, the
  buffer in NVSHMEM's symmetric heap, the other hosts' ranks reached by NVSHMEM puts.

The buffers are allocated once per group, never inside a handler.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_ep._native import ffi
from jax_ep.backends import hierarchical
from jax_ep.backends import topology as topology_lib
from jax_ep.config import EPConfig

def buffer_bytes(config: EPConfig, low_latency: bool = False, network: bool = False,
                 num_hosts: int = 0) -> int:
  """Bytes of one rank's library-owned communication buffer (0 without the extension; at one
  rank, only a group with the low-latency buffers has one). `network`: a group with ranks on
  `num_hosts` hosts: its buffer (NVSHMEM's symmetric heap) gains the outbox the low-latency
  puts read and the rail exchange's regions, and each host's own group for the
  high-throughput ops has a buffer of its own (included)."""
  ext = ffi.extension()
  if ext is None or (config.num_ranks == 1 and not low_latency):
    return 0
  itemsize = np.dtype(config.dtype).itemsize
  hosts = num_hosts if network and num_hosts >= 2 else 0
  total = int(ext.group_buffer_bytes(config.num_ranks, config.max_tokens_per_rank,
                                     config.hidden, config.num_topk, itemsize,
                                     config.num_experts if low_latency else 0,
                                     bool(network), hosts))
  if hosts:
    host_cfg = hierarchical.host_config(config, hosts)
    if host_cfg.num_ranks > 1:
      total += buffer_bytes(host_cfg)
  return total


@dataclasses.dataclass
class Transport:
  """The native groups of this process for one `jax_ep.Group` (one per local device of the
  mesh), what both transports share: their ids, the error records, and the close."""
  group_ids: list[int]
  key: str
  # The processes that hold the mesh's devices (None: every process of the job).
  process_ids: list[int] | None = None
  closed: bool = False

  # Where this transport's keys live in the `jax.distributed` key-value store.
  _KV_PREFIX = "jax_ep/group"

  @property
  def primary_id(self) -> int:
    return self.group_ids[0]

  @property
  def receives_while_sending(self) -> bool:
    """Whether every local group's dispatch places the other ranks' rows as they land."""
    ext = ffi.extension()
    return all(bool(ext.group_receives_while_sending(gid)) for gid in self.group_ids)

  def error(self) -> str | None:
    ext = ffi.extension()
    for gid in self.group_ids:
      message = ext.group_error(gid)
      if message:
        return message
    return None

  def close(self, barrier_timeout_s: float = 60.0) -> str | None:
    """Waits for every process of the group to finish with the buffers, then frees them.

    Returns the message of a timeout the kernels recorded (read after the device finished its
    work, so a kernel that was still running counts too), or None.
    """
    if self.closed:
      return None
    self.closed = True
    client = _client()
    everyone_here = True
    # Only a group that spans processes waits for them; a barrier over the whole job from a
    # group of this process alone would wait for processes that never reach it.
    others = (jax.process_count() > 1 if self.process_ids is None
              else set(self.process_ids) != {jax.process_index()})
    if client is not None and others:
      try:
        client.wait_at_barrier(f"{self._KV_PREFIX}/{self.key}/close",
                               int(barrier_timeout_s * 1000), process_ids=self.process_ids)
      except Exception:  # noqa: BLE001 - a vanished peer must not stop us freeing our memory
        everyone_here = False
    ext = ffi.extension()
    messages = [ext.group_destroy(gid) for gid in self.group_ids]
    self._release(everyone_here)
    return next((m for m in messages if m), None)

  def _release(self, everyone_here: bool) -> None:
    """Frees what the transport holds beside the native groups (after they are destroyed)."""


@dataclasses.dataclass
class PeerTransport(Transport):
  """The peer transport: the ranks of one NVLink domain reach each other's buffers by pointer
  (CUDA IPC between processes, peer access inside one)."""
  _KV_PREFIX = "jax_ep/peer"


@dataclasses.dataclass
class NetworkTransport(Transport):
  """The network transport: a group whose ranks span several hosts. Its buffer lies in
  NVSHMEM's symmetric heap; ranks on this rank's host are reached by pointer, the others by
  NVSHMEM puts.

  Attributes:
    network_buffer: the buffer's address in the symmetric heap (0 once freed).
    topology: the map of hosts.
    network_ranks: the ranks this process reaches by puts.
    host_group_id: this host's own group (the peer transport, over which the high-throughput
      ops forward; None on a host of one rank).
    equal_hosts: whether the hosts are ones those ops run on: of equal size, contiguous in rank
      order (`hierarchical.contiguous_hosts`).
  """
  network_buffer: int = 0
  topology: topology_lib.Topology | None = None
  network_ranks: tuple[int, ...] = ()
  host_group_id: int | None = None
  equal_hosts: bool = False

  _KV_PREFIX = "jax_ep/network"

  def _release(self, everyone_here: bool) -> None:
    if self.network_buffer:
      # nvshmem_free is collective: only when every process reached the close (otherwise the
      # symmetric buffer stays allocated until the process ends, never a hang).
      if everyone_here:
        from jax_ep.backends import nvshmem
        nvshmem.load().symmetric_free(self.network_buffer)
      self.network_buffer = 0


def _client():
  from jax._src import distributed
  return distributed.global_state.client


def not_one_group(config: EPConfig, mesh) -> str | None:
  """Why `mesh` is not one EP group of `config` for a transport (its axes other than the EP
  axis must have size 1: a transport joins the devices of one group), or None."""
  if mesh.devices.size == config.num_ranks:
    return None
  return (f"the mesh's axes other than the EP axis must have size 1; this mesh has axes "
          f"{dict(mesh.shape)}")


def create_peer(config: EPConfig, mesh, key: str, *, num_sms: int, timeout_s: float,
                process_ids: list[int] | None = None, low_latency: bool = False,
                exchange_timeout_s: float = 60.0, devices=None) -> PeerTransport:
  """Allocates this process's buffers, exchanges handles with the peers and connects them.

  `process_ids`: the processes holding the mesh's devices when they are not all of the job's
  (the group's members, as `jax_ep.Group` found them); `close()` waits for those alone.
  `devices`: the group's devices in rank order, when they are not the mesh's (one host's of a
  network group).
  """
  ext = ffi.extension()
  if ext is None:
    raise RuntimeError("jax_ep.Group(backend='cuda'): the CUDA extension is not built")
  why = None if devices is not None else not_one_group(config, mesh)
  if why is not None:
    raise NotImplementedError(
        f"jax_ep.Group(backend='cuda'): the peer transport joins one EP group: {why} (use "
        f"backend='reference' for several EP groups in one mesh)")
  devices = list(mesh.devices.flat) if devices is None else list(devices)
  me = jax.process_index()
  local = [(rank, d) for rank, d in enumerate(devices) if d.process_index == me]
  itemsize = np.dtype(config.dtype).itemsize

  def make(rank, device):
    return int(ext.group_create(
        device.local_hardware_id, rank, config.num_ranks, config.num_experts, config.num_topk,
        config.hidden, config.max_tokens_per_rank, itemsize, config.capacity, num_sms,
        float(timeout_s), bool(low_latency), expert_alignment=config.expert_alignment))

  if len(local) == len(devices):  # one process drives every device of the group
    ids = []
    try:
      for rank, d in local:
        ids.append(make(rank, d))
      ext.group_connect_local(ids)
    except BaseException:
      for gid in ids:
        ext.group_destroy(gid)
      raise
    return PeerTransport(ids, key, [me])
  if len(local) != 1:
    raise NotImplementedError(
        f"jax_ep.Group(backend='cuda'): process {me} holds {len(local)} of the group's "
        f"{len(devices)} devices; supported: one process for all devices, or one per device")
  rank, device = local[0]
  gid = make(rank, device)
  client = _client()
  prefix = f"{PeerTransport._KV_PREFIX}/{key}"
  client.key_value_set_bytes(f"{prefix}/{rank}", bytes(ext.group_ipc_handle(gid)))
  handles = []
  for peer in range(config.num_ranks):
    try:
      handles.append(client.blocking_key_value_get_bytes(f"{prefix}/{peer}",
                                                         int(exchange_timeout_s * 1000)))
    except Exception as e:  # noqa: BLE001 - the KV client reports a timeout as a runtime error
      ext.group_destroy(gid)
      raise TimeoutError(f"jax_ep.Group: rank {peer} did not publish its buffer handle within "
                         f"{exchange_timeout_s} s (key {prefix}/{peer}): {e}") from None
  try:
    ext.group_connect(gid, handles)
  except BaseException:
    ext.group_destroy(gid)
    raise
  return PeerTransport([gid], key, process_ids)


def create_network(config: EPConfig, mesh, key: str, *, num_sms: int, timeout_s: float,
                   topology: topology_lib.Topology, low_latency: bool = True,
                   exchange_timeout_s: float = 60.0) -> NetworkTransport:
  """A group whose ranks span several hosts (`topology`): the buffer in NVSHMEM's symmetric
  heap, ranks on this rank's host reached by pointer (`nvshmem_ptr`), the others by NVSHMEM
  puts (ffi/nvshmem/); with hosts of equal size, also this host's own group (the peer
  transport, `host_group_id`) for the high-throughput ops' forwarding
  (jax_ep/backends/hierarchical.py).

  NVSHMEM's PEs are the job's processes: the group must hold every process, one device each,
  rank r on process r. On virtual hosts (one machine) NVSHMEM gets the settings of PEs that
  share a machine (`jax_ep.backends.nvshmem.shared_gpu_env`) where the environment does not
  set them.
  """
  from jax_ep.backends import nvshmem
  ext = ffi.extension()
  if ext is None:
    raise RuntimeError("jax_ep.Group(backend='cuda'): the CUDA extension is not built")
  devices = list(mesh.devices.flat)
  why = not_one_group(config, mesh)
  if why is not None:
    raise NotImplementedError(f"jax_ep.Group: the network transport joins one EP group: {why}")
  if (len(devices) != jax.process_count()
      or any(d.process_index != r for r, d in enumerate(devices))):
    raise NotImplementedError(
        "jax_ep.Group: the network transport runs one process per device with rank r on "
        f"process r (NVSHMEM's PEs are the job's processes); this mesh puts its "
        f"{len(devices)} devices on processes {[d.process_index for d in devices]} of "
        f"{jax.process_count()}")
  module = nvshmem.load()
  rank = jax.process_index()
  device = devices[rank].local_hardware_id
  num_hosts = topology.num_hosts
  forwarding = hierarchical.contiguous_hosts(topology.hosts)
  itemsize = np.dtype(config.dtype).itemsize
  nbytes = int(ext.group_buffer_bytes(
      config.num_ranks, config.max_tokens_per_rank, config.hidden, config.num_topk, itemsize,
      config.num_experts if low_latency else 0, True, num_hosts))
  if topology.virtual:
    nvshmem.apply_env(nvshmem.shared_gpu_env())
  nvshmem.apply_env({"NVSHMEM_SYMMETRIC_SIZE": str(nvshmem.symmetric_heap_size(nbytes))})
  member = nvshmem.join(f"group/{key}", rank, config.num_ranks, device,
                        timeout_s=exchange_timeout_s)
  if member.num_pes != config.num_ranks:
    raise RuntimeError(f"jax_ep.Group: NVSHMEM has {member.num_pes} PEs, the group "
                       f"{config.num_ranks} ranks")
  buffer = int(module.symmetric_alloc(nbytes))  # collective, every process in group order
  gid = int(ext.group_create(
      device, rank, config.num_ranks, config.num_experts, config.num_topk, config.hidden,
      config.max_tokens_per_rank, itemsize, config.capacity, num_sms, float(timeout_s),
      bool(low_latency), network_buffer=buffer, network_buffer_bytes=nbytes,
      num_hosts=num_hosts))
  ids = [gid]
  try:
    # Every rank's header is written before any rank reads its peers' (ConnectTable).
    client = _client()
    if client is not None and config.num_ranks > 1:
      try:
        client.wait_at_barrier(f"{NetworkTransport._KV_PREFIX}/{key}/created",
                               int(exchange_timeout_s * 1000))
      except Exception as e:  # noqa: BLE001 - the KV client reports a timeout as a runtime error
        raise TimeoutError(f"jax_ep.Group: not every rank created its network buffer within "
                           f"{exchange_timeout_s} s: {e}") from None
    host = topology.host_of(rank)
    table = []
    for r in range(config.num_ranks):
      if r == rank:
        table.append(buffer)
      elif topology.host_of(r) == host:
        table.append(int(module.peer_address(buffer, r)))  # 0 where NVSHMEM cannot map it: puts
      else:
        table.append(0)
    ext.group_connect_table(gid, table, int(module.send_address()))
    module.warm_put_kernels(device)
    host_group_id = None
    ranks = topology.hosts[host]
    if forwarding and len(ranks) > 1:
      # This host's own group: the high-throughput ops forward over it (peer transport).
      host_cfg = hierarchical.host_config(config, num_hosts)
      sub = create_peer(host_cfg, mesh, f"{key}/host{host}", num_sms=num_sms,
                        timeout_s=timeout_s,
                        process_ids=[devices[r].process_index for r in ranks],
                        exchange_timeout_s=exchange_timeout_s,
                        devices=[devices[r] for r in ranks])
      host_group_id = sub.primary_id
      ids.append(host_group_id)
  except BaseException:
    for i in ids:
      ext.group_destroy(i)
    raise
  return NetworkTransport(ids, key, None, network_buffer=buffer, topology=topology,
                            network_ranks=tuple(r for r, t in enumerate(table) if t == 0),
                            host_group_id=host_group_id, equal_hosts=forwarding)
