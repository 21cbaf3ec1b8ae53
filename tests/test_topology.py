"""The network transport's map of the group (jax_ep/backends/topology.py), from the ranks' host
names."""

import pytest

from jax_ep.backends import topology


def test_one_host_is_one_host():
  t = topology.discover(["a"] * 8)
  assert t.hosts == (tuple(range(8)),) and t.num_hosts == 1 and not t.virtual


def test_hosts_in_order_of_their_lowest_rank():
  t = topology.discover(["b", "b", "a", "a", "b", "a"])
  assert t.hosts == ((0, 1, 4), (2, 3, 5))
  assert t.gpus_per_host == (3, 3)
  assert [t.host_of(r) for r in range(6)] == [0, 0, 1, 1, 0, 1]
  assert [t.local_index(r) for r in range(6)] == [0, 1, 0, 1, 2, 2]


def test_uneven_hosts_and_r_not_a_multiple_of_eight():
  t = topology.discover(["n0"] * 8 + ["n1"] * 4)
  assert t.num_ranks == 12 and t.gpus_per_host == (8, 4)
  # Same local index where the other host has it, else modulo its GPU count.
  assert t.peer_on(1, 2) == 10
  assert t.peer_on(1, 6) == 10
  assert t.peer_on(0, 3) == 3


@pytest.mark.parametrize("k,hosts", [(2, ((0, 1, 2, 3), (4, 5, 6, 7))),
                                     (4, ((0, 1), (2, 3), (4, 5), (6, 7)))])
def test_virtual_hosts_split_one_host(k, hosts):
  t = topology.discover(["a"] * 8, virtual_hosts=k)
  assert t.hosts == hosts and t.virtual
  assert t.peer_on(1, t.local_index(0)) == hosts[1][0]


def test_bad_arguments_name_the_argument():
  with pytest.raises(ValueError, match="must divide the group's 8 ranks"):
    topology.discover(["a"] * 8, virtual_hosts=3)
  with pytest.raises(ValueError, match="splits the ranks of one host, but this group runs on 2"):
    topology.discover(["a", "b"], virtual_hosts=2)
  with pytest.raises(ValueError, match="positive int, got 0"):
    topology.discover(["a"] * 2, virtual_hosts=0)
  with pytest.raises(ValueError, match="at least one rank"):
    topology.discover([])
  with pytest.raises(ValueError, match="rank 9 is not in this group of 2"):
    topology.discover(["a", "a"]).host_of(9)


def test_group_virtual_hosts_arguments_are_checked():
  """`jax_ep.Group(virtual_hosts=k)`: k must divide R, the cuda backend's network transport
  carries the low-latency ops only, and the reference backend has no transports."""
  import jax
  import jax_ep
  mesh = jax.make_mesh((8,), ("ep",), devices=jax.devices()[:8])
  kw = dict(num_experts=16, num_topk=2, hidden=128, max_tokens_per_rank=4)
  with pytest.raises(ValueError, match="virtual_hosts=3 must divide the 8 ranks"):
    jax_ep.Group(mesh, "ep", virtual_hosts=3, low_latency=True, **kw)
  with pytest.raises(ValueError, match="virtual_hosts must be positive, got 0"):
    jax_ep.Group(mesh, "ep", virtual_hosts=0, low_latency=True, **kw)
  with pytest.raises(ValueError, match="backend='reference' has no transports"):
    jax_ep.Group(mesh, "ep", virtual_hosts=2, low_latency=True, backend="reference", **kw)
  if all(d.platform == "cpu" for d in mesh.devices.flat):
    with pytest.raises(ValueError, match="needs the cuda backend, which cannot run this group here"):
      jax_ep.Group(mesh, "ep", virtual_hosts=2, low_latency=True, **kw)
  # One virtual host is the real one: an ordinary group.
  group = jax_ep.Group(mesh, "ep", virtual_hosts=1, low_latency=True, **kw)
  assert group.topology is None and group.network_ranks == ()
  group.close()


def test_memory_estimate_of_a_network_group_includes_the_outbox():
  import jax_ep
  if jax_ep._native.ffi.extension() is None:
    pytest.skip("sizes come from the extension's buffer layout")
  kw = dict(num_ranks=8, num_experts=64, num_topk=4, hidden=256, max_tokens_per_rank=16,
            backend="cuda", low_latency=True)
  one_host = jax_ep.memory_bytes(**kw)
  network = jax_ep.memory_bytes(**kw, network=True)
  # Two outboxes of L * R * T_max rows (one per op) and their codes and counts.
  rows = 8 * 8 * 16
  assert network.comm_buffer_bytes - one_host.comm_buffer_bytes >= 2 * rows * 256 * 2 + rows * 4
  assert network.low_latency_buffer_bytes > one_host.low_latency_buffer_bytes
  # Across 2 hosts: the rail exchange's blocks (two inbox sets and the outbox of 2 x T_max
  # records of a row, K ids and K weights) and each host's own group for the forwarding.
  hosts = jax_ep.memory_bytes(**kw, network=True, num_hosts=2)
  record = 256 * 2 + 2 * 16
  host_group = jax_ep.memory_bytes(**dict(kw, num_ranks=4, num_experts=32, low_latency=False))
  assert (hosts.comm_buffer_bytes - network.comm_buffer_bytes
          >= 3 * 2 * 16 * record + host_group.comm_buffer_bytes)
  assert hosts.low_latency_buffer_bytes == network.low_latency_buffer_bytes
