"""What a user gets by default (CPU): the backend `auto` picks and why, the kernels' limits
checked when a group is created, and run-time failures that reach the host without a host
callback per op (the watchdog and its error plumbing, with the native side faked)."""

import logging
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _status
from jax_ep.backends import registry as group_module, transport
from jax_ep._native import ffi as _ffi
from jax_ep.backends.options import CommOptions
from jax_ep.config import EPConfig
from jax_ep._native.limits import KernelLimits, cuda_violation
from ep_test_base import count_primitive, rank_mesh

LIMITS = KernelLimits(max_experts=1024, max_topk=32, max_slots=1 << 30, hidden_multiple=8,
                      max_capacity=2**31 - 1, max_ranks=64, max_num_sms=1024)


def _config(num_ranks=2, num_experts=16, num_topk=4, hidden=128, max_tokens=32, capacity=None):
  num_local = num_experts // num_ranks
  if capacity is None:
    capacity = num_ranks * max_tokens * min(num_topk, num_local)
  return EPConfig("ep", num_ranks, num_experts, num_topk, hidden, max_tokens,
                  np.dtype(jnp.bfloat16), capacity)


class _FakeMesh:
  """What backend selection reads of a mesh: devices (platform, process), axes, shape."""

  def __init__(self, processes, platform="gpu", shape=None):
    devices = [types.SimpleNamespace(platform=platform, process_index=p, id=i)
               for i, p in enumerate(processes)]
    self.devices = np.array(devices, dtype=object)
    if shape is not None:
      self.devices = self.devices.reshape(shape)
    self.axis_names = ("ep",) if self.devices.ndim == 1 else ("dp", "ep")
    self.shape = dict(zip(self.axis_names, self.devices.shape))


def _support(mesh, config, process_index=0, **kwargs):
  kwargs.setdefault("limits", LIMITS)
  kwargs.setdefault("extension_built", True)
  kwargs.setdefault("peer_access", True)
  return group_module.cuda_support(mesh, config, 24, process_index=process_index, **kwargs)


@pytest.mark.parametrize("processes,me", [
    ([0], 0),                 # one rank
    ([0, 1, 2, 3], 2),        # one process per GPU (IPC), or processes sharing one GPU (MPS)
    ([0] * 8, 0),             # one process driving every GPU (peer access)
])
def test_cuda_runs_every_process_model_of_the_transport(processes, me):
  config = _config(num_ranks=len(processes), num_experts=8 * len(processes))
  assert _support(_FakeMesh(processes), config, process_index=me) is None


def test_cuda_runs_one_ep_group_beside_axes_of_size_one():
  """A ('data', 'expert') mesh of 1 x R is one EP group: the transport runs it."""
  config = _config(num_ranks=4, num_experts=32)
  assert _support(_FakeMesh([0, 1, 2, 3], shape=(1, 4)), config) is None


@pytest.mark.parametrize("mesh,config,why", [
    (_FakeMesh([0, 0], platform="cpu"), _config(), "the mesh has cpu devices"),
    (_FakeMesh([0, 0, 1, 1]), _config(num_ranks=4),
     "process 0 holds 2 of the group's 4 devices"),
    (_FakeMesh([0, 1, 2, 3], shape=(2, 2)), _config(),
     "the mesh's axes other than the EP axis must have size 1"),
    (_FakeMesh([0, 1]), _config(hidden=100), "hidden=100 is not a multiple of 8"),
    (_FakeMesh([0]), _config(num_ranks=1, num_topk=40, num_experts=64),
     "num_topk=40 is above the kernels' limit of 32"),
    (_FakeMesh([0]), _config(num_ranks=1, num_experts=2048),
     "num_experts=2048 is above the kernels' limit of 1024"),
    (_FakeMesh([0, 1]), _config(num_experts=4096), "2048 local experts is above"),
])
def test_cuda_refusals_name_the_reason(mesh, config, why):
  assert why in _support(mesh, config)


def test_cuda_needs_one_host_and_peer_access():
  config = _config(num_ranks=4, num_experts=32)
  why = _support(_FakeMesh([0, 1, 2, 3]), config, hosts=["a", "a", "b", "b"])
  assert "the group's processes run on 2 hosts" in why
  assert _support(_FakeMesh([0, 1, 2, 3]), config, hosts=["a"] * 4) is None
  why = _support(_FakeMesh([0] * 4), config, peer_access=False)
  assert "cannot access each other's memory" in why


def test_cuda_needs_the_extension():
  why = _support(_FakeMesh([0]), _config(num_ranks=1), extension_built=False)
  assert "the CUDA extension is not built" in why


def test_limits_are_the_extensions_table():
  ext = _ffi.extension()
  if ext is None:
    pytest.skip("built without the CUDA extension")
  from jax_ep._native.limits import kernel_limits
  assert kernel_limits() == LIMITS
  assert cuda_violation(_config(), kernel_limits(), 24) is None


def test_auto_says_once_which_backend_and_why(monkeypatch, caplog):
  monkeypatch.setattr(group_module, "_SAID", set())
  monkeypatch.setattr(group_module, "cuda_support", lambda *a, **k: None)
  mesh = _FakeMesh([0, 0])
  with caplog.at_level(logging.INFO, logger="jax_ep"):
    for _ in range(3):
      assert group_module._resolve_backend("auto", mesh, _config(), CommOptions()) == (
          "cuda", "CUDA GPUs, one process driving 2 devices")
  assert caplog.text.count("jax_ep.Group(backend='auto'): cuda backend (CUDA GPUs, one "
                           "process driving 2 devices)") == 1
  monkeypatch.setattr(group_module, "cuda_support", lambda *a, **k: "no GPU here")
  with caplog.at_level(logging.INFO, logger="jax_ep"):
    assert group_module._resolve_backend("auto", _FakeMesh([0], "cpu"), _config(),
                                         CommOptions()) == (
        "reference", "no GPU here")
  assert "reference backend (no GPU here)" in caplog.text


def test_auto_on_this_machine():
  group = jax_ep.Group(rank_mesh(2), "ep", num_experts=8, num_topk=2, hidden=128,
                       max_tokens_per_rank=4)
  if all(d.platform == "gpu" for d in group.mesh.devices.flat) and _ffi.extension():
    assert group.backend_name == "cuda"
  else:
    assert group.backend_name == "reference"
    assert group.backend_reason


def test_cuda_refuses_a_hidden_size_the_kernels_cannot_take(monkeypatch):
  """backend='cuda' on GPUs with a hidden size off the kernels' 16-byte rows: refused when the
  group is created, naming the limit (GPUs and extension faked on the CPU)."""
  fake_ext = types.SimpleNamespace(limits=lambda: dict(vars(LIMITS)))
  monkeypatch.setattr(_ffi, "extension", lambda: fake_ext)
  with pytest.raises(ValueError, match=r"backend='cuda' cannot run this group: hidden=100 is "
                                       r"not a multiple of 8"):
    jax_ep.Group(_FakeMesh([0]), "ep", num_experts=8, num_topk=2, hidden=100,
                 max_tokens_per_rank=4, backend="cuda")


# ------------------------------------------------------------------------- run-time failures

class _FakeTransport:
  """Stands in for `transport.Transport`: an error record the test fills in."""
  group_ids = [1]
  primary_id = 1
  receives_while_sending = False

  def __init__(self):
    self.message = None
    self.closed = False
    self.reads = 0

  def error(self):
    self.reads += 1
    return self.message

  def close(self):
    self.closed = True
    return self.late  # what the mailbox says once the device has finished

  late = None


@pytest.fixture
def peer_group(monkeypatch):
  """A two-rank group wired to a fake peer transport (the cuda backend's Python side)."""
  if jax.process_count() > 1:
    pytest.skip("single-process fake")
  transports = []

  def create(*args, **kwargs):
    transports.append(_FakeTransport())
    return transports[-1]
  monkeypatch.setattr(group_module, "cuda_support", lambda *a, **k: None)
  monkeypatch.setattr(transport, "create_peer", create)
  monkeypatch.setattr(_status.WATCHDOG, "interval_s", 0.01)

  def make(**kwargs):
    g = jax_ep.Group(rank_mesh(2), "ep", num_experts=8, num_topk=2, hidden=128,
                     max_tokens_per_rank=4, backend="cuda", **kwargs)
    return g, transports[-1]
  return make


TIMEOUT = ("jax_ep.dispatch: rank 0 timed out after 2.0 s waiting for rank 1 (call 3): rank 1's "
           "dispatch data did not arrive. The group is unusable; recreate it.")


def _wait_for(predicate, timeout_s=5.0):
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < deadline, "timed out waiting"
    time.sleep(0.01)


def _trace_dispatch(group):
  def body(x, idx, w):
    recv, _ = jax_ep.dispatch(group, x[0], idx[0], w[0])
    return recv.x[None]
  sharding = jax.NamedSharding(group.mesh, P("ep"))
  structs = [jax.ShapeDtypeStruct((2, 4, 128), jnp.bfloat16, sharding=sharding),
             jax.ShapeDtypeStruct((2, 4, 2), jnp.int32, sharding=sharding),
             jax.ShapeDtypeStruct((2, 4, 2), jnp.float32, sharding=sharding)]
  mapped = jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep"))
  return jax.jit(mapped).trace(*structs)


def test_watchdog_logs_a_timeout_and_every_entry_point_raises_it(peer_group, caplog):
  group, transport = peer_group()
  with caplog.at_level(logging.ERROR, logger="jax_ep"):
    _wait_for(lambda: transport.reads > 0)  # the watchdog polls without being asked
    group.check()  # nothing yet
    transport.message = TIMEOUT  # what the kernels write into the mapped mailbox
    _wait_for(lambda: TIMEOUT in caplog.text)
  assert caplog.text.count(TIMEOUT) == 1  # logged once, at once
  with pytest.raises(TimeoutError, match=r"rank 0 timed out .* waiting for rank 1 \(call 3\)"):
    group.check()
  with pytest.raises(TimeoutError, match="rank 0 timed out"):  # the next op traced
    _trace_dispatch(group)
  group.close()  # raised to the caller already: close frees without raising again
  assert transport.closed


def test_close_raises_a_failure_nobody_saw(peer_group):
  group, transport = peer_group()
  transport.message = TIMEOUT
  with pytest.raises(TimeoutError, match="rank 0 timed out"):
    group.close()
  assert transport.closed and group.closed
  reads = transport.reads
  time.sleep(0.1)
  assert transport.reads == reads  # a closed group's record is no longer read


def test_close_raises_a_timeout_recorded_while_it_waited_for_the_device(peer_group):
  """A kernel still running when close() is called may time out while close() waits for the
  device; its record is read before the mailbox is freed and raised."""
  group, transport = peer_group()
  transport.late = TIMEOUT
  with pytest.raises(TimeoutError, match="rank 0 timed out"):
    group.close()


def test_leaving_a_with_block_on_an_exception_keeps_that_exception(peer_group):
  group, transport = peer_group()
  transport.message = TIMEOUT
  with pytest.raises(KeyError):
    with group:
      raise KeyError("the block's own error")
  assert group.closed


@pytest.mark.skipif(_ffi.extension() is None, reason="built without the CUDA extension")
def test_no_host_callback_in_any_op_by_default(peer_group):
  """The peer ops' programs carry no host callback unless a debug setting asks for one."""
  def callbacks(group):
    return count_primitive(_trace_dispatch(group).jaxpr.jaxpr, "debug_callback")
  assert callbacks(peer_group()[0]) == 0
  assert callbacks(peer_group(raise_on_timeout=True)[0]) == 1
  assert callbacks(peer_group(strict=True)[0]) == 1


def test_reference_ops_have_no_host_callback_by_default():
  group = jax_ep.Group(rank_mesh(2), "ep", num_experts=8, num_topk=2, hidden=128,
                       max_tokens_per_rank=4, backend="reference")
  assert count_primitive(_trace_dispatch(group).jaxpr.jaxpr, "debug_callback") == 0


def test_status_aggregates_the_drops_of_every_shard():
  """Every shard that dropped adds to one message; recording never raises (a callback may run
  more than once per dispatch), check() does."""
  status = _status.GroupStatus("g")
  status.strict_dispatch("rank 0", 0, 10)
  status.strict_dispatch("rank 1", 5, 10)
  status.strict_dispatch("rank 2 dp 1", 7, 10)
  status.strict_dispatch("rank 1", 5, 10)  # the same dispatch again (vmap, remat)
  message, error_type = status.failure()
  assert error_type is jax_ep.CapacityOverflowError
  assert ("g dropped rows that did not fit in capacity=10 (rank 1: 5 rows, rank 2 dp 1: 7 "
          "rows, in the last dispatch that dropped); a capacity of at least 17 would fit "
          "them") in message
  assert not status.raised
  with pytest.raises(jax_ep.CapacityOverflowError, match="rank 1: 5 rows"):
    status.raise_if_failed()
  assert status.raised


def test_status_names_a_capacity_with_the_alignment_padding():
  """With expert_alignment the rows that dropped may sit behind padding: the capacity named
  includes the most padding the alignment adds."""
  status = _status.GroupStatus("g")
  status.strict_dispatch("rank 0", 3, 10, padding=60)
  message, _ = status.failure()
  assert ("a capacity of 73 would fit them (with the 60 rows of padding expert_alignment can "
          "add)") in message


def test_strict_drops_on_a_data_axis_under_vmap_and_remat():
  """Strict mode on a ('dp', 'ep') mesh, under vmap and jax.checkpoint (whose callbacks run
  several times per dispatch): the dispatch that drops completes, and check() names each
  shard that dropped once."""
  if jax.process_count() > 1 or jax.device_count() < 4:
    pytest.skip("needs 4 devices in one process")
  mesh = jax.make_mesh((2, 2), ("dp", "ep"), devices=jax.devices()[:4])
  group = jax_ep.Group(mesh, "ep", num_experts=4, num_topk=2, hidden=8, max_tokens_per_rank=6,
                       capacity=2, strict=True, dtype=jnp.float32)

  def layer(x):
    idx = jnp.tile(jnp.array([0, 1], jnp.int32), (x.shape[0], 1))
    recv, handle = jax_ep.dispatch(group, x, idx, jnp.ones(idx.shape, jnp.float32))
    return jax_ep.combine(group, recv.x, handle)

  def body(xs):
    return jax.vmap(jax.checkpoint(layer))(xs)
  xs = jax.device_put(jnp.ones((3, 24, 8)), jax.NamedSharding(mesh, P(None, ("dp", "ep"))))
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, ("dp", "ep")),
                               out_specs=P(None, ("dp", "ep"))))
  with jax.set_mesh(mesh):
    jax.block_until_ready(jax.grad(lambda xs: jnp.sum(step(xs)))(xs))
  with pytest.raises(jax_ep.CapacityOverflowError) as error:
    group.check()
  # Experts 0 and 1 live on EP rank 0: both of its data replicas dropped, each named once.
  for dp in (0, 1):
    assert str(error.value).count(f"rank 0 dp {dp}: 22 rows") == 1, str(error.value)
  assert "rank 1" not in str(error.value)


def test_a_group_of_this_process_alone_closes_without_waiting_for_the_others(monkeypatch):
  """In a job of several processes (a test under `jax_ep.launch`), a group whose devices are all
  this process's waits at its close for no one: a barrier over the whole job waits its full
  timeout for processes that never reach it. A group over several processes waits for its
  members; one over the whole job (no `process_ids`), for every process."""
  if jax.process_count() > 1:
    pytest.skip("single-process fake")

  class Ext:
    destroyed = []

    def group_create(self, *args, **kwargs):
      return 7

    def group_connect_local(self, ids):
      pass

    def group_destroy(self, gid):
      self.destroyed.append(gid)
      return ""

  class Client:
    barriers = []

    def wait_at_barrier(self, name, timeout_ms, process_ids=None):
      self.barriers.append(process_ids)

  ext, client = Ext(), Client()
  monkeypatch.setattr(_ffi, "extension", lambda: ext)
  monkeypatch.setattr(transport, "_client", lambda: client)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  mine = transport.create_peer(_config(num_ranks=1, num_experts=4, num_topk=2), rank_mesh(1),
                               "one-process", num_sms=1, timeout_s=1.0, process_ids=[0],
                               low_latency=True)
  assert mine.process_ids == [jax.process_index()]
  mine.close()
  assert client.barriers == [] and ext.destroyed == [7]
  transport.PeerTransport([8], "two-processes", [0, 1]).close()
  transport.PeerTransport([9], "the-job").close()
  assert client.barriers == [[0, 1], None] and ext.destroyed == [7, 8, 9]
