"""docs/DESIGN.md section 1's "Names across the layers" table against the code: every name it
gives exists where it says, and every registered FFI target is in it under its wrapper's name."""

import dataclasses
import pathlib
import re

import pytest

import jax_ep
from jax_ep.backends import base, cuda, cuda_ops, hierarchical, primitives, reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = {"cuda_ops": cuda_ops, "primitives": primitives, "reference": reference,
           "hierarchical": hierarchical, "cuda": cuda}


def _table():
  text = (ROOT / "docs" / "DESIGN.md").read_text()
  section = text.split("### Names across the layers", 1)[1]
  rows = []
  for line in section.splitlines():
    if not line.startswith("|"):
      if rows:
        break
      continue
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if cells[0] in ("op", "---"):
      continue
    rows.append(cells)
  return rows


def _names(cell):
  return re.findall(r"`([^`]+)`", cell)


def _registered_targets():
  return set(re.findall(r'dict\["(jax_ep_[a-z_]+)"\]', (ROOT / "ffi" / "module.cc").read_text()))


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
                                                cuda.CudaBackend)), name
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
  listed = {t for row in ROWS for t in _names(row[4])}
  registered = _registered_targets()
  assert registered == listed
  for target in registered:
    assert callable(getattr(cuda_ops, target.removeprefix("jax_ep_"))), target


def test_the_backend_protocol_uses_the_public_names():
  methods = {name for name in vars(base.HighThroughputBackend) if not name.startswith("_")}
  assert {"dispatch", "dispatch_cached", "combine", "combine_vjp"} <= methods
  assert not hasattr(base.Backend, "dispatch_tokens")
