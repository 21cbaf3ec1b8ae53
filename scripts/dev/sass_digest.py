"""Digests of the kernels' machine code (SASS), to show that a change left the kernels as they were.

  python scripts/dev/sass_digest.py [TREE] > after.json          # TREE: a checkout (default: here)
  python scripts/dev/sass_digest.py --compare before.json after.json

Compiles every `ffi/kernels/*.cu` of TREE for sm_90a with the flags of CMakeLists.txt, dumps the
SASS with `cuobjdump -sass`, and prints one digest per kernel of its instructions (addresses and
line information left out, so moving code or editing comments does not change it). `--compare`
matches the two sets by digest: a kernel renamed without a change to its code still matches,
and every kernel whose code changed is listed. Needs nvcc and cuobjdump (with nvdisasm), not a
GPU.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

FLAGS = ["-O3", "-std=c++17", "-arch=sm_90a", "-cubin"]


def _cuobjdump() -> str:
  """$CUOBJDUMP, cuobjdump on PATH, or the one of the `nvidia-cuda-cuobjdump` wheel (which
  needs nvdisasm beside it: `pip install nvidia-cuda-nvdisasm`)."""
  import shutil
  import site
  found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
  for root in [*site.getsitepackages(), site.getusersitepackages()]:
    found = found or next(iter(glob.glob(os.path.join(root, "nvidia", "*", "bin", "cuobjdump"))),
                          None)
  if not found:
    sys.exit("sass_digest.py needs cuobjdump: put it on PATH, set CUOBJDUMP, or "
             "`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`")
  return found


def _instructions(sass: str) -> dict[str, list[str]]:
  """`{function: [instruction, ...]}` from `cuobjdump -sass` output."""
  functions: dict[str, list[str]] = {}
  current = None
  for line in sass.splitlines():
    match = re.match(r"\s*Function : (\S+)", line)
    if match:
      current = functions.setdefault(match.group(1), [])
      continue
    match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
    if current is not None and match:
      current.append(match.group(1))
  return functions


def _without_source_hash(name: str) -> str:
  """The mangled name with its anonymous namespace's identifier (which carries a hash of the
  source path, `<length>_GLOBAL__N__<hash>_<file>_cu_<hash>`) cut to `_GLOBAL__N_`."""
  match = re.search(r"(\d+)_GLOBAL__N_", name)
  if not match:
    return name
  end = match.start() + len(match.group(1)) + int(match.group(1))
  return name[:match.start()] + "11_GLOBAL__N_" + name[end:]


def digests(tree: str) -> dict[str, str]:
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    for source in sorted(glob.glob(os.path.join(tree, "ffi", "kernels", "*.cu"))):
      cubin = os.path.join(tmp, os.path.basename(source) + ".cubin")
      subprocess.run(["nvcc", *FLAGS, "-I", tree, "-o", cubin, source], check=True)
      tool = _cuobjdump()
      env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(tool),
                                                   os.environ.get("PATH", "")]))
      sass = subprocess.run([tool, "-sass", cubin], check=True, capture_output=True, text=True,
                            env=env).stdout
      for name, body in _instructions(sass).items():
        out[_without_source_hash(name)] = hashlib.sha1("\n".join(body).encode()).hexdigest()[:16]
  return out


def compare(before: dict[str, str], after: dict[str, str]) -> int:
  by_digest = {}
  for name, digest in before.items():
    by_digest.setdefault(digest, []).append(name)
  changed = 0
  for name, digest in sorted(after.items()):
    if before.get(name) == digest:
      continue
    if digest in by_digest:
      print(f"renamed, same code: {by_digest[digest][0]} -> {name}")
    else:
      print(f"changed or new: {name}")
      changed += 1
  left = set(before.values()) - set(after.values())
  for name, digest in sorted(before.items()):
    if digest in left:
      print(f"gone: {name}")
      changed += 1
  print(f"{len(after)} kernels, {changed} with code that differs")
  return 1 if changed else 0


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("tree", nargs="?", default=os.path.dirname(os.path.dirname(
      os.path.dirname(os.path.abspath(__file__)))))
  parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  args = parser.parse_args()
  if args.compare:
    before, after = (json.load(open(p)) for p in args.compare)
    sys.exit(compare(before, after))
  json.dump(digests(args.tree), sys.stdout, indent=1, sort_keys=True)
  print()


if __name__ == "__main__":
  main()
