"""The two build descriptions (CMake, the canonical one, and Bazel) list every source under ffi/."""

import os
import re

import pytest

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


def _listed_ffi_paths(text):
  return sorted(set(re.findall(r"\bffi/[\w/]+\.(?:cc|cu|h|cuh)\b", text)))


def test_build_files_list_no_missing_source():
  # A file moved or removed must leave both descriptions (CMake would fail at configure time,
  # Bazel only when the target is built).
  for name in ("CMakeLists.txt", "BUILD.bazel"):
    stale = [s for s in _listed_ffi_paths(_read(name)) if not os.path.isfile(os.path.join(ROOT, s))]
    assert not stale, f"{name} lists files that do not exist: {stale}"


def _readme_tree():
  tree = re.search(r"```\nffi/\n(.*?)```", _read("ffi/README.md"), re.DOTALL)
  assert tree, "ffi/README.md: no file tree"
  return sorted("ffi/" + name for name in re.findall(r"^  (\S+)", tree.group(1), re.MULTILINE))


def test_readme_lists_every_ffi_source():
  listed = _readme_tree()
  missing = [s for s in _ffi_sources() if s not in listed]
  assert not missing, f"ffi/README.md's file tree does not list {missing}"
  stale = [s for s in listed if not os.path.isfile(os.path.join(ROOT, s))]
  assert not stale, f"ffi/README.md's file tree lists files that do not exist: {stale}"


def test_no_globs_hide_ffi_sources():
  # Native sources are listed by name so a file added to one build cannot be missed by the other
  # (the Python package may be globbed: it is not compiled).
  for pattern in re.findall(r"glob\(([^)]*)\)", _read("BUILD.bazel")):
    assert "ffi" not in pattern, f"BUILD.bazel globs native sources: {pattern}"
  assert "GLOB" not in _read("CMakeLists.txt")


def _bazel_copts(target):
  block = re.search(rf'name = "{re.escape(target)}",(.*?)\n\)', _read("BUILD.bazel"), re.DOTALL)
  assert block, f"BUILD.bazel has no target {target}"
  copts = re.search(r"copts = \[(.*?)\]", block.group(1), re.DOTALL)
  return re.findall(r'"([^"]+)"', copts.group(1)) if copts else []


def test_bazel_compiles_the_kernels_with_cmakes_flags():
  cmake = _read("CMakeLists.txt")
  kernel_flags = re.search(r"target_compile_options\(jax_ep_kernels PRIVATE\s+"
                           r"\$<\$<COMPILE_LANGUAGE:CUDA>:([^>]*)>\)", cmake)
  assert kernel_flags, "CMakeLists.txt: kernel flags not found"
  standard = re.search(r"set\(CMAKE_CUDA_STANDARD (\d+)\)", cmake).group(1)
  assert sorted(kernel_flags.group(1).split() + [f"-std=c++{standard}"]) == sorted(
      _bazel_copts("ep_kernels"))
  handler_flags = re.search(r"target_compile_options\(_jax_ep_ffi PRIVATE ([^)]*)\)", cmake)
  assert handler_flags.group(1).split() == _bazel_copts("ffi_handlers")


def test_bazel_builds_cmakes_architectures():
  cmake_archs = re.search(r'set\(CMAKE_CUDA_ARCHITECTURES "([^"]+)"\)', _read("CMakeLists.txt"))
  want = [f"sm_{a.removesuffix('-real')}" for a in cmake_archs.group(1).split(";")]
  bazel_archs = re.search(r"--@rules_cuda//cuda:archs=(\S+)", _read(".bazelrc"))
  assert bazel_archs and bazel_archs.group(1).split(",") == want


def _includes(path):
  """The headers `path` includes, as written between the quotes or angle brackets."""
  return re.findall(r'^#include\s+[<"]([^>"]+)[>"]', _read(path), re.M)


@pytest.mark.parametrize("layer,forbidden", [
    # The kernels know CUDA alone.
    ("ffi/kernels/", ("xla/", "nanobind", "ffi/runtime/", "ffi/handlers/", "ffi/nvshmem/")),
    # The native group (buffers, peers, IPC, NVSHMEM state, error mailbox, topology, registry)
    # is host C++ over the kernels' types: no XLA header, no handler, no nanobind.
    ("ffi/runtime/", ("xla/", "nanobind", "ffi/handlers/")),
    # The handlers adapt XLA FFI to the runtime's public API, not its internals.
    ("ffi/handlers/", ("nanobind", "ffi/runtime/group_internal.h")),
])
def test_each_ffi_layer_includes_only_the_layers_below(layer, forbidden):
  sources = [s for s in _ffi_sources() if s.startswith(layer)]
  assert sources, layer
  for source in sources:
    for header in _includes(source):
      assert not header.startswith(forbidden) and not any(f in header for f in forbidden), (
          f"{source} includes {header}")
