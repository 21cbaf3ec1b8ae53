"""How a compiled program names its native group, and why that is safe with jax's persistent
compilation cache (docs/decisions.md, "Group ids").

Every custom call on a group carries `group`, a dictionary attribute of the group's `id` (its
number in the process that traced the program) and the configuration it was built for, which
the handlers decode by field name and compare with the group they find. The CPU tests check
what the program carries, XLA's decoding of it (through the extension's XLA:CPU probe target)
and that it is part of the cache key; the GPU tests run programs on groups created in
different orders in two processes sharing one cache, and a program whose id names a group of
another configuration.
"""

import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from jax_ep.backends import cuda_ops
from jax_ep.config import EPConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "mp_workers", "compilation_cache_worker.py")
_HAS_FLATBUFFERS = importlib.util.find_spec("flatbuffers") is not None


def _config(capacity=16, dtype=jnp.bfloat16):
  return EPConfig("ep", 2, 8, 2, 128, 4, np.dtype(dtype), capacity)


class _FakeExtension:
  @staticmethod
  def peer_dispatch_workspace_elems(*_):
    return 16


def _group_ops(config, group_id):
  """Every op on a native group, as `(name, fn)`: `fn()` issues it (T = 4 tokens)."""
  t, k, h, r = 4, config.num_topk, config.hidden, config.num_ranks
  n, local = r * config.max_tokens_per_rank, config.num_local_experts
  slab = config.low_latency_slab
  i32, f32, dt = jnp.int32, jnp.float32, config.dtype
  x, idx, w = jnp.zeros((t, h), dt), jnp.zeros((t, k), i32), jnp.zeros((t, k), f32)
  layout = cuda_ops.PeerLayout(jnp.zeros((t, r), i32), jnp.zeros((n, k), i32),
                               jnp.zeros((n, k), f32), jnp.zeros((r,), i32),
                               jnp.zeros((local,), i32), idx)
  eo = jnp.zeros((config.capacity, h), dt)
  ll_layout = cuda_ops.LowLatencyLayout(idx, jnp.zeros((local, slab), i32),
                                        jnp.zeros((local,), i32))
  slabs = jnp.zeros((local, slab, h), dt)
  sent = jnp.zeros((), i32)
  return [
      ("peer_dispatch", lambda: cuda_ops.peer_dispatch(config, group_id, x, idx, w)),
      ("peer_dispatch_cached",
       lambda: cuda_ops.peer_dispatch_cached(config, group_id, x, layout, True)),
      ("peer_combine", lambda: cuda_ops.peer_combine(config, group_id, eo, layout,
                                                               True)),
      ("peer_combine_vjp",
       lambda: cuda_ops.peer_combine_vjp(config, group_id, x, eo, layout)),
      ("rail_exchange", lambda: cuda_ops.rail_exchange(
          config, group_id, 2, (x,), jnp.zeros((2, config.max_tokens_per_rank), i32),
          jnp.zeros((2,), i32), jnp.zeros((2,), i32))),
      ("low_latency_dispatch", lambda: cuda_ops.low_latency_dispatch(config, group_id, x, idx)),
      ("low_latency_dispatch_send",
       lambda: cuda_ops.low_latency_dispatch_send(config, group_id, x, idx)),
      ("low_latency_dispatch_wait",
       lambda: cuda_ops.low_latency_dispatch_wait(config, group_id, sent, idx, dt)),
      ("low_latency_combine",
       lambda: cuda_ops.low_latency_combine(config, group_id, slabs, ll_layout, w)),
      ("low_latency_combine_send",
       lambda: cuda_ops.low_latency_combine_send(config, group_id, slabs, ll_layout)),
      ("low_latency_combine_wait",
       lambda: cuda_ops.low_latency_combine_wait(config, group_id, sent, ll_layout, w, dt)),
  ]


def _lowered(fn):
  return jax.jit(fn).lower()


def _group_attributes(text):
  """The `group` attribute of every jax_ep custom call in a lowered program's text, as a dict of
  its fields (None where a call has none); fails where the attribute is not a dictionary of
  i64 fields."""
  found = []
  for line in text.splitlines():
    if "stablehlo.custom_call @jax_ep_" not in line:
      continue
    match = re.search(r"\bgroup = (\{[^}]*\}|[^,}]+)", line)
    if match is None:
      found.append(None)
      continue
    value = match.group(1)
    assert value.startswith("{"), f"the group attribute is not a dictionary: {value}"
    fields = re.findall(r"(\w+) = (-?\d+) : i64", value)
    assert len(fields) == value.count("="), f"a field of the group attribute is not i64: {value}"
    found.append({name: int(v) for name, v in fields})
  return found


def _struct_members():
  """The field names `XLA_FFI_REGISTER_STRUCT_ATTR_DECODING` decodes `group` into."""
  with open(os.path.join(REPO, "ffi", "handlers", "group_common.h")) as f:
    source = f.read()
  registration = source.split("XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(", 1)[1].split(";", 1)[0]
  return re.findall(r'StructMember<int64_t>\("(\w+)"\)', registration)


def test_the_python_table_and_the_cpp_struct_name_the_same_fields():
  """One table of fields in Python (`GROUP_FIELDS`), one struct in C++ (`GroupRef`): the same
  names; the order does not matter, since both sides go by name."""
  assert _struct_members() == ["id", *cuda_ops.GROUP_FIELDS]
  config = _config(capacity=24, dtype=jnp.float32)
  attrs = cuda_ops.group_attrs(config, 5)
  assert set(attrs) == {"group"}
  assert attrs["group"] == {"id": 5, "num_ranks": 2, "num_experts": 8, "num_topk": 2,
                            "hidden": 128, "max_tokens_per_rank": 4, "itemsize": 4,
                            "capacity": 24, "expert_alignment": 1}
  aligned = dataclasses.replace(config, expert_alignment=16)
  assert cuda_ops.group_attrs(aligned, 5)["group"]["expert_alignment"] == 16


@functools.cache
def _probe_registered() -> bool:
  """Registers the extension's XLA:CPU targets (jax_ep_group_probe); False without it."""
  from jax_ep._native import ffi
  ext = ffi.extension()
  if ext is None:
    return False
  for name, capsule in ext.cpu_registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  return True


def _probe(attrs):
  """The `group` attribute as XLA decodes it for the handlers (GroupRef), by field name."""
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    fields = jax.ffi.ffi_call("jax_ep_group_probe",
                              jax.ShapeDtypeStruct((len(_struct_members()),), jnp.int32))(**attrs)
  return dict(zip(_struct_members(), np.asarray(fields).tolist()))


def test_the_handlers_decode_the_attribute_python_builds():
  """XLA's decoding of `group` into the handlers' struct (the CPU probe decodes it as the group
  ops do): every field arrives under its name, whatever the order of the Python table."""
  if not _probe_registered():
    pytest.skip("needs the built extension (its XLA:CPU probe target)")
  config = dataclasses.replace(_config(capacity=24, dtype=jnp.float32), expert_alignment=16)
  attrs = cuda_ops.group_attrs(config, 7)
  assert _probe(attrs) == {"id": 7, "num_ranks": 2, "num_experts": 8, "num_topk": 2,
                           "hidden": 128, "max_tokens_per_rank": 4, "itemsize": 4,
                           "capacity": 24, "expert_alignment": 16}
  reordered = {"group": dict(reversed(list(attrs["group"].items())))}
  assert _probe(reordered) == _probe(attrs)


@pytest.mark.parametrize("change,message", [
    ("missing", "Wrong number of attributes: expected 9 attributes but got 8"),
    ("extra", "Wrong number of attributes: expected 9 attributes but got 10"),
    ("not_i64", "expected S64 but got S32"),
])
def test_an_attribute_of_another_layout_is_refused_before_the_handler(change, message):
  """A program built by another version of jax_ep (a field missing, added, or of another type)
  fails in XLA's decoding of the struct, saying what differs, instead of reading a field in
  the wrong place."""
  if not _probe_registered():
    pytest.skip("needs the built extension (its XLA:CPU probe target)")
  group = dict(cuda_ops.group_attrs(_config(), 7)["group"])
  if change == "missing":
    del group["capacity"]
  elif change == "extra":
    group["num_hosts"] = np.int64(1)
  else:
    group["capacity"] = np.int32(16)
  with pytest.raises(Exception, match=message):
    _probe({"group": group})


def test_every_group_op_names_its_group_and_configuration(monkeypatch):
  """Each op's custom call carries the group's id and the configuration it was traced with."""
  monkeypatch.setattr(cuda_ops.ffi, "extension", lambda: _FakeExtension)
  config = _config()
  for name, fn in _group_ops(config, 7):
    attrs = _group_attributes(_lowered(fn).as_text())
    assert attrs, name
    for group in attrs:
      # An MLIR dictionary attribute with the named fields, the C++ struct's.
      assert group is not None, name
      assert sorted(group) == sorted(_struct_members()), name
      assert group == cuda_ops.group_attrs(config, 7)["group"], name


def test_the_compilation_cache_key_holds_the_group(monkeypatch):
  """jax's persistent compilation cache keys on the program text, group id and configuration
  included: a program traced on another group (another id here) or for another configuration
  is another entry, so an executable the cache returns is one this process would have
  compiled for the same group. (jax._src.cache_key: jax has no public API for the key.)"""
  from jax._src import cache_key, compiler
  monkeypatch.setattr(cuda_ops.ffi, "extension", lambda: _FakeExtension)
  device = jax.devices()[0]
  options = compiler.get_compile_options(num_replicas=1, num_partitions=1)

  def key(config, group_id):
    x = jnp.zeros((4, config.hidden), config.dtype)
    idx = jnp.zeros((4, config.num_topk), jnp.int32)
    module = jax.jit(lambda x, idx: cuda_ops.low_latency_dispatch(
        config, group_id, x, idx)).lower(x, idx).compiler_ir("stablehlo")
    return cache_key.get(module, np.array([device]), options, device.client)

  same = key(_config(), 1)
  assert key(_config(), 1) == same
  assert key(_config(), 2) != same
  # A capacity the low-latency op's shapes do not show: only the group attribute tells them
  # apart.
  assert key(_config(capacity=32), 1) != same


def _run_worker(role, backend, mode, directory):
  env = dict(os.environ)
  if backend == "reference":
    # The reference backend's two ranks are host devices, also on a machine with one GPU.
    env["JAX_PLATFORMS"] = "cpu"
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
  else:
    # This process may hold most of the GPU's memory already (XLA preallocates on first use):
    # the worker allocates what it uses.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  result = subprocess.run([sys.executable, WORKER, role, backend, mode, str(directory)],
                          env=env, capture_output=True, text=True, timeout=300)
  log = result.stdout + result.stderr
  assert result.returncode == 0, log
  lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
  assert lines, log
  return json.loads(lines[-1][len("RESULT "):]), log


@pytest.mark.skipif(not _HAS_FLATBUFFERS, reason="jax.export's serialization needs flatbuffers")
def test_reference_programs_are_shared_between_processes(tmp_path):
  """The reference backend's programs hold no group: the second process finds the first
  one's executable for both of its groups, and the results match the oracle."""
  if jax.process_count() > 1:
    pytest.skip("starts processes of its own; run it outside the launcher")
  first, log = _run_worker("first", "reference", "high_throughput", tmp_path)
  assert first["B"] == {"hits": 0, "ok": True, "error": None}, log
  second, log = _run_worker("second", "reference", "high_throughput", tmp_path)
  for name in ("B", "A"):
    assert second[name]["ok"] and second[name]["hits"] >= 1, log
  assert second["exported"]["ok"], log


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_FLATBUFFERS, reason="jax.export's serialization needs flatbuffers")
@pytest.mark.parametrize("mode", ["low_latency", "high_throughput"])
def test_cached_programs_run_on_this_process_groups(tmp_path, mode):
  """Process 1 creates groups A then B (one configuration) and runs a step on B; process 2
  creates B then A, sharing the persistent compilation cache. Its step on B has B's id here
  (not process 1's), so it compiles anew; its step on A has the id B had in process 1, so it
  loads process 1's executable, which runs on this process's A: results match the oracle.
  Process 1's program, exported, runs in process 2 on A (its id there, one configuration). In
  a third process the id names a group of a larger capacity: the handlers refuse it, naming
  the group and the field."""
  if jax.process_count() > 1:
    pytest.skip("starts processes of its own; run it outside the launcher")
  if mode == "high_throughput" and jax.device_count() < 2:
    pytest.skip("at one rank the high-throughput ops run the local kernels, on no group")
  first, log = _run_worker("first", "cuda", mode, tmp_path)
  assert first["B"] == {"hits": 0, "ok": True, "error": None}, log
  second, log = _run_worker("second", "cuda", mode, tmp_path)
  assert second["B"] == {"hits": 0, "ok": True, "error": None}, log
  assert second["A"]["ok"] and second["A"]["hits"] >= 1, log
  assert second["exported"]["ok"], log
  other, log = _run_worker("other", "cuda", mode, tmp_path)
  error = other["exported"]["error"] or ""
  assert not other["exported"]["ok"], log
  assert re.search(r"the program was built for native group \d+ with capacity = \d+, but "
                   r"group \d+ of this process has capacity = \d+", error), log


@pytest.mark.gpu
def test_a_program_built_for_another_configuration_is_refused(monkeypatch):
  """A program whose group id names a group of another configuration fails before any kernel
  runs, naming the group id, the field and both values; the group itself keeps working."""
  from jax_ep._native import effects
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  group = jax_ep.Group(mesh, "ep", num_experts=8, num_topk=2, hidden=256,
                       max_tokens_per_rank=8, dtype=jnp.bfloat16, backend="cuda",
                       low_latency=True, timeout_s=20.0)
  try:
    gid, config = group.backend.ll_group_id, group.config
    x, idx = jnp.ones((8, 256), jnp.bfloat16), jnp.tile(jnp.arange(2, dtype=jnp.int32), (8, 1))

    def count(cfg):
      return jax.jit(lambda x, idx: cuda_ops.low_latency_dispatch(cfg, gid, x, idx)[2])(x, idx)

    other = dataclasses.replace(config, capacity=config.capacity + 16)
    with pytest.raises(Exception, match=(
        f"the program was built for native group {gid} with capacity = {other.capacity}, "
        f"but group {gid} of this process has capacity = {config.capacity}")):
      jax.block_until_ready(count(other))
    effects.settle()
    # A program of another version of jax_ep, whose attribute lacks a field: XLA's decoding
    # of the struct refuses it by name, before the handler runs.
    monkeypatch.setattr(cuda_ops, "GROUP_FIELDS",
                        {k: v for k, v in cuda_ops.GROUP_FIELDS.items() if k != "capacity"})
    with pytest.raises(Exception, match="Wrong number of attributes"):
      jax.block_until_ready(count(config))
    effects.settle()
    monkeypatch.undo()
    # Every token names experts 0 and 1: one row each there.
    np.testing.assert_array_equal(np.asarray(count(config)), [8, 8, 0, 0, 0, 0, 0, 0])
  finally:
    group.close()
