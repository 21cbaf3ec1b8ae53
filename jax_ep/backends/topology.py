"""Which ranks share a host: the network transport's map of the group.

Ranks on one host reach each other through the peer transport (CUDA IPC); ranks on different
hosts through NVSHMEM. The hosts are discovered from the processes (the host name each rank's
process runs on, gathered through `jax.distributed`), never assumed: hosts may hold different
numbers of GPUs and R need not be a multiple of 8. For testing on one machine, `virtual_hosts=k`
splits one host's ranks into k hosts whose traffic between them must take the NVSHMEM path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Topology:
  """`hosts[h]`: the ranks on host h, ascending; hosts ordered by their lowest rank."""
  hosts: tuple[tuple[int, ...], ...]
  virtual: bool = False

  @property
  def num_ranks(self) -> int:
    return sum(len(h) for h in self.hosts)

  @property
  def num_hosts(self) -> int:
    return len(self.hosts)

  @property
  def gpus_per_host(self) -> tuple[int, ...]:
    return tuple(len(h) for h in self.hosts)

  def host_of(self, rank: int) -> int:
    for h, ranks in enumerate(self.hosts):
      if rank in ranks:
        return h
    raise ValueError(f"jax_ep.topology: rank {rank} is not in this group of {self.num_ranks}")

  def local_index(self, rank: int) -> int:
    """The rank's index among its host's ranks."""
    return self.hosts[self.host_of(rank)].index(rank)

  def peer_on(self, host: int, local_index: int) -> int:
    """The rank of `host` that a rank with `local_index` on another host exchanges with: the
    one with the same local index, or (a host with fewer GPUs) that index modulo its count."""
    ranks = self.hosts[host]
    return ranks[local_index % len(ranks)]


def discover(host_names: Sequence[str], *, virtual_hosts: int | None = None) -> Topology:
  """The topology of a group whose rank r runs on host `host_names[r]`.

  Args:
    host_names: one entry per rank (a process that drives several of the group's devices gives
      its host for each).
    virtual_hosts: split the ranks of one host into this many hosts of equal size, contiguous
      in rank order (the emulation of several hosts on one machine); None or 1 for the real
      hosts.
  """
  names = list(host_names)
  if not names:
    raise ValueError("jax_ep.topology: host_names must name the host of at least one rank")
  if virtual_hosts is None or virtual_hosts == 1:
    order: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
      order.setdefault(name, []).append(rank)
    return Topology(hosts=tuple(tuple(r) for r in order.values()))
  if not isinstance(virtual_hosts, int) or isinstance(virtual_hosts, bool) or virtual_hosts < 1:
    raise ValueError(f"jax_ep.topology: virtual_hosts must be a positive int, got "
                     f"{virtual_hosts!r}")
  if len(set(names)) != 1:
    raise ValueError(f"jax_ep.topology: virtual_hosts splits the ranks of one host, but this "
                     f"group runs on {len(set(names))} hosts")
  num_ranks = len(names)
  if num_ranks % virtual_hosts:
    raise ValueError(f"jax_ep.topology: virtual_hosts={virtual_hosts} must divide the group's "
                     f"{num_ranks} ranks")
  size = num_ranks // virtual_hosts
  return Topology(hosts=tuple(tuple(range(h * size, (h + 1) * size))
                              for h in range(virtual_hosts)), virtual=True)
