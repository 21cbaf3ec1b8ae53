"""Draws jax_ep's layers by what their files import (jax_ep/) and include (ffi/), and checks
that every arrow points down.

  python scripts/layers.py            # both drawings, as docs/layout.md and ffi/README.md hold
  python scripts/layers.py --check    # exit 1 where an arrow points up (tests run this too)

Each line is one layer, top to bottom, with the layers its files import or include (`--check`
counts the lines of an arrow that points up). A layer may point only at layers below it; the order and
the layers are the tables of docs/layout.md (jax_ep/) and ffi/README.md (ffi/). Reads the files
as text (Python's ast for imports, `#include "..."` lines for C++): it runs nothing.
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# jax_ep/'s layers, top to bottom: (name, the files it holds). A module belongs to the first
# layer whose prefix its dotted name starts with.
PYTHON_LAYERS = (
    ("demo", ("jax_ep.demo",)),
    ("testing/", ("jax_ep.testing",)),
    ("public API", ("jax_ep.__init__", "jax_ep.group", "jax_ep.ops", "jax_ep.layer",
                    "jax_ep.layer_checks", "jax_ep.nnx", "jax_ep.routing", "jax_ep.gmm",
                    "jax_ep.sizing", "jax_ep._status", "jax_ep.")),
    ("backends/", ("jax_ep.backends",)),
    ("experts/", ("jax_ep.experts",)),
    ("_native/", ("jax_ep._native", "jax_ep._jax_ep_ffi", "jax_ep._jax_ep_nvshmem")),
    ("launch/", ("jax_ep.launch",)),
    ("config.py", ("jax_ep.config",)),
)
# Layers side by side: neither may import the other.
PYTHON_BESIDE = {("backends/", "experts/")}

# ffi/'s layers, top to bottom, by path prefix.
CPP_LAYERS = (
    ("module", ("ffi/module.cc",)),
    ("nvshmem/", ("ffi/nvshmem/",)),
    ("handlers/", ("ffi/handlers/",)),
    ("runtime/", ("ffi/runtime/",)),
    ("kernels/", ("ffi/kernels/",)),
)
CPP_BESIDE = {("nvshmem/", "handlers/")}


def _layer_of(name: str, layers) -> str | None:
  """The layer holding `name` (a dotted module or a path): the one of its longest prefix. A
  prefix ending in "/" or "." holds what starts with it (and "jax_ep." the package itself);
  another prefix holds itself and its submodules."""
  best = None
  for layer, prefixes in layers:
    for prefix in prefixes:
      if prefix.endswith(("/", ".")):
        hit = name.startswith(prefix) or name == prefix.rstrip("./")
      else:
        hit = name == prefix or name.startswith(prefix + ".")
      if hit and (best is None or len(prefix) > best[1]):
        best = (layer, len(prefix))
  return None if best is None else best[0]


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  if parts[-1] == "__init__" and len(parts) > 2:
    parts = parts[:-1]
  return ".".join(parts)


def _python_imports(path: pathlib.Path) -> list[str]:
  """The jax_ep modules `path` imports (absolute imports; `from jax_ep import x` names
  jax_ep.x)."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out += [a.name for a in node.names if a.name.startswith("jax_ep")]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
        and node.module.startswith("jax_ep"):
      if node.module == "jax_ep":
        out += [f"jax_ep.{a.name}" for a in node.names]
      else:
        out.append(node.module)
  return out


def _cpp_includes(path: pathlib.Path) -> list[str]:
  return re.findall(r'^#include\s+"(ffi/[^"]+)"', path.read_text(), re.M)


def edges(tree: str):
  """`{(from layer, to layer): count}` of the import (include) lines between layers."""
  counts = collections.Counter()
  if tree == "jax_ep":
    layers = PYTHON_LAYERS
    for path in sorted((ROOT / "jax_ep").rglob("*.py")):
      here = _layer_of(_module_name(path), layers)
      for target in _python_imports(path):
        there = _layer_of(target, layers)
        if here and there and there != here:
          counts[(here, there)] += 1
  else:
    layers = CPP_LAYERS
    for path in sorted((ROOT / "ffi").rglob("*")):
      if path.suffix not in (".cc", ".cu", ".h", ".cuh"):
        continue
      here = _layer_of(str(path.relative_to(ROOT)), layers)
      for target in _cpp_includes(path):
        there = _layer_of(target, layers)
        if here and there and there != here:
          counts[(here, there)] += 1
  return counts


def violations(tree: str) -> list[str]:
  """The arrows that point up, or between layers side by side."""
  layers, beside = ((PYTHON_LAYERS, PYTHON_BESIDE) if tree == "jax_ep"
                    else (CPP_LAYERS, CPP_BESIDE))
  order = {name: i for i, (name, _) in enumerate(layers)}
  bad = []
  for (here, there), n in sorted(edges(tree).items()):
    if order[there] < order[here] or (here, there) in beside or (there, here) in beside:
      bad.append(f"{tree}: {here} -> {there} ({n})")
  return bad


def drawing(tree: str) -> str:
  layers = PYTHON_LAYERS if tree == "jax_ep" else CPP_LAYERS
  counts = edges(tree)
  width = max(len(name) for name, _ in layers)
  lines = []
  for name, _ in layers:
    targets = [(there, n) for (here, there), n in counts.items() if here == name]
    order = {layer: i for i, (layer, _) in enumerate(layers)}
    targets.sort(key=lambda t: order[t[0]])
    shown = ", ".join(there for there, _ in targets) or "nothing"
    lines.append(f"{name:<{width}}  -> {shown}")
  return "\n".join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true")
  args = parser.parse_args()
  bad = violations("jax_ep") + violations("ffi")
  if args.check:
    print("\n".join(bad) if bad else "layers: every arrow points down")
    return 1 if bad else 0
  for tree in ("jax_ep", "ffi"):
    print(f"{tree}/ by its {'imports' if tree == 'jax_ep' else 'includes'}:\n{drawing(tree)}\n")
  if bad:
    print("arrows that point up:\n" + "\n".join(bad))
  return 0


if __name__ == "__main__":
  sys.exit(main())
