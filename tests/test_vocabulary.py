"""docs/DESIGN.md section 1's "Names across the layers" table against the code: every name it
gives exists where it says, and every registered FFI target is in it under its wrapper's name."""

import dataclasses
import pathlib
import re

import pytest

import jax_ep
from jax_ep._native import own_stream
from jax_ep.backends import base, cuda, cuda_ops, hierarchical, primitives, reference, transport

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = {"cuda_ops": cuda_ops, "primitives": primitives, "reference": reference,
           "hierarchical": hierarchical, "cuda": cuda}


def _table(after="### Names across the layers", header="op"):
  """The rows of the first table after `after` in docs/DESIGN.md whose first column is
  `header`."""
  text = (ROOT / "docs" / "DESIGN.md").read_text()
  section = text.split(after, 1)[1]
  rows, inside = [], False
  for line in section.splitlines():
    if not line.startswith("|"):
      if rows:
        break
      continue
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if cells[0] == header:
      inside = True
      continue
    if inside and cells[0] != "---":
      rows.append(cells)
  return rows


def _names(cell):
  return re.findall(r"`([^`]+)`", cell)


def _registered_targets():
  """The CUDA targets `registrations()` returns (not the XLA:CPU probe of
  `cpu_registrations()`, which no op calls)."""
  source = (ROOT / "ffi" / "module.cc").read_text()
  body = source.split("nb::dict Registrations() {", 1)[1].split("\n}\n", 1)[0]
  return set(re.findall(r'dict\["(jax_ep_[a-z_]+)"\]', body))


ROWS = _table()


def test_the_table_has_every_op():
  ops = [row[0] for row in ROWS]
  assert len(ROWS) == 12 and all(len(row) == 7 for row in ROWS), ROWS
  for op in ("layout", "dispatch", "combine", "combine's backward", "low-latency dispatch",
             "low-latency combine", "rail exchange (across hosts)"):
    assert op in ops


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_every_name_exists(row):
  _, public, method, wrappers, targets, handlers, kernels = row
  for name in _names(public):
    assert "." in name or hasattr(jax_ep, name), name  # `jax.grad` of ...: not ours
  for name in _names(method):
    if "." in name:
      owner, attr = name.split(".")
      if owner == "Hierarchy":
        assert attr in {f.name for f in dataclasses.fields(hierarchical.Hierarchy)}
      else:
        assert hasattr(MODULES[owner], attr), name
    else:
      assert any(hasattr(cls, name) for cls in (base.Backend, reference.ReferenceBackend,
                                                cuda.LocalBackend)), name
  for name in _names(wrappers):
    module, attr = name.split(".")
    assert hasattr(MODULES[module], attr), name
  registered = _registered_targets()
  for target in _names(targets):
    assert target in registered, target
    assert f"cuda_ops.{target.removeprefix('jax_ep_')}" in _names(wrappers), target
  for name in _names(handlers):
    assert (ROOT / "ffi" / "handlers" / name).is_file(), name
  for name in _names(kernels):
    path = ROOT / "ffi" / name if "/" in name else ROOT / "ffi" / "kernels" / name
    assert path.is_file(), name


def test_every_target_is_in_the_table_and_has_its_wrapper():
  """The own stream's twins (`<target>_own_stream`) and `jax_ep_join` are named in the text
  under the table; the twins' targets are in it."""
  listed = {t for row in ROWS for t in _names(row[4])}
  registered = _registered_targets()
  twins = {t for t in registered if t.endswith(own_stream.SUFFIX)}
  assert registered - twins - {own_stream.JOIN} == listed
  assert {t.removesuffix(own_stream.SUFFIX) for t in twins} == listed - {
      t for t in listed if t.startswith("jax_ep_low_latency")}
  text = (ROOT / "docs" / "DESIGN.md").read_text()
  assert f"`<target>{own_stream.SUFFIX}`" in text and f"`{own_stream.JOIN}`" in text
  for target in registered - twins - {own_stream.JOIN}:
    assert callable(getattr(cuda_ops, target.removeprefix("jax_ep_"))), target


def test_the_backend_protocol_uses_the_public_names():
  methods = {name for name in vars(base.HighThroughputBackend) if not name.startswith("_")}
  assert {"dispatch", "dispatch_cached", "combine", "combine_vjp"} <= methods
  assert not hasattr(base.Backend, "dispatch_tokens")


KINDS = _table(header="kind")


def test_the_kinds_table_names_one_class_and_transport_per_kind():
  assert [row[0] for row in KINDS] == ["local", "peer", "network"]
  for kind, _, backend, transports, native in KINDS:
    for name in _names(backend):
      cls = getattr(cuda, name)
      assert cls.name == "cuda" and base.Backend in cls.__mro__, name
    for name in _names(transports):
      if name.endswith(".py"):
        continue
      assert hasattr(transport, name), name
    for name in _names(native):
      if name.startswith("jax_ep::"):
        namespace = name.removeprefix("jax_ep::")
        sources = "".join(p.read_text() for p in (ROOT / "ffi").rglob("*") if p.is_file())
        assert f"namespace jax_ep::{namespace}" in sources, name
      else:
        assert list((ROOT / "ffi").glob(name)), name


def test_the_network_backend_composes_the_peer_backend_rather_than_extending_it():
  assert not issubclass(cuda.NetworkBackend, cuda.PeerBackend)
  assert issubclass(transport.PeerTransport, transport.Transport)
  assert issubclass(transport.NetworkTransport, transport.Transport)
  assert not issubclass(transport.NetworkTransport, transport.PeerTransport)


def test_no_name_says_intranode():
  """"Intranode" meant the peer transport, the network transport and the one-rank group at
  once; each has its own name now (peer, network, local; the native group for what they
  share)."""
  for target in _registered_targets():
    assert "intranode" not in target, target
  for path in list((ROOT / "ffi").rglob("*")) + list((ROOT / "jax_ep" / "backends").rglob("*")):
    assert "intranode" not in path.name, path
  for module in (cuda, cuda_ops, transport):
    for name in vars(module):
      assert "intranode" not in name.lower(), (module.__name__, name)
  for path in (ROOT / "ffi").rglob("*"):
    if path.suffix in (".h", ".cc", ".cu", ".cuh"):
      assert "namespace jax_ep::intranode" not in path.read_text(), path
