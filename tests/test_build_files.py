"""The two build descriptions (CMake, the canonical one, and Bazel) list every source under ffi/."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_SUFFIXES = (".cc", ".cu", ".h", ".cuh")


def _ffi_sources():
  found = []
  for dirpath, _, files in os.walk(os.path.join(ROOT, "ffi")):
    for name in files:
      if name.endswith(SOURCE_SUFFIXES):
        found.append(os.path.relpath(os.path.join(dirpath, name), ROOT))
  return sorted(found)


def _read(name):
  with open(os.path.join(ROOT, name)) as f:
    return f.read()


def test_there_are_ffi_sources():
  sources = _ffi_sources()
  assert any(s.endswith(".cu") for s in sources), sources
  assert any(s.endswith(".cc") for s in sources), sources


def test_cmake_lists_every_ffi_source():
  cmake = _read("CMakeLists.txt")
  missing = [s for s in _ffi_sources() if s not in cmake]
  assert not missing, f"CMakeLists.txt does not list {missing}"


def test_bazel_lists_every_ffi_source():
  bazel = _read("BUILD.bazel")
  # Bazel labels are relative to the package of BUILD.bazel (the repository root here).
  missing = [s for s in _ffi_sources() if not re.search(rf'"{re.escape(s)}"', bazel)]
  assert not missing, f"BUILD.bazel does not list {missing}"


def test_no_globs_hide_ffi_sources():
  # Native sources are listed by name so a file added to one build cannot be missed by the other
  # (the Python package may be globbed: it is not compiled).
  for pattern in re.findall(r"glob\(([^)]*)\)", _read("BUILD.bazel")):
    assert "ffi" not in pattern, f"BUILD.bazel globs native sources: {pattern}"
  assert "GLOB" not in _read("CMakeLists.txt")
