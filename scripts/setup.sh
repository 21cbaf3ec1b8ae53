#!/usr/bin/env bash
# Creates .venv (Python >= 3.12), installs the pinned JAX and the test extras, and builds jax_ep
# (the CUDA extension too when nvcc is found; JAX_EP_ENABLE_CUDA=OFF skips it). Idempotent, and
# quick when nothing changed: each step records a hash of what it depends on in .venv/ and is
# skipped while that hash is unchanged (JAX_EP_SETUP_FORCE=1 redoes every step):
#   the installs: this script, pyproject.toml, Python's version, nvcc's presence, NVSHMEM's switch;
#   the build:    the installs' hash, CMakeLists.txt, the contents of ffi/, the names of the files
#                 under jax_ep/ (the editable install maps each module to its file; edits to
#                 Python files need nothing), the version, JAX_EP_ENABLE_CUDA and CMAKE_ARGS.
# A fresh clone has no .venv and so does every step. A step that fails leaves its stamp out, so
# the next run redoes it. Rebuilding after a change to ffi/ recompiles only what changed (the
# build directory is kept: build/).
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
  for candidate in "${PYTHON:-}" python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python" python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "no Python >= 3.12 found (set PYTHON=...)" >&2; return 1
}

# sha256 of the named inputs (files, folders' files and their names, literal strings).
digest() {
  {
    for input in "$@"; do
      if [ -d "$input" ]; then
        find "$input" -type f -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z |
          xargs -0 -r sha256sum
      elif [ -f "$input" ]; then
        sha256sum "$input"
      else
        printf '%s\n' "$input"
      fi
    done
  } | sha256sum | cut -d' ' -f1
}

# Stamp $1 holds hash $2: the step is done.
up_to_date() { [ -z "${JAX_EP_SETUP_FORCE:-}" ] && [ "$(cat ".venv/$1" 2>/dev/null)" = "$2" ]; }

if [ ! -x .venv/bin/python ]; then
  "$(pick_python)" -m venv .venv
fi
. .venv/bin/activate

has_nvcc=no
if command -v nvcc >/dev/null 2>&1; then has_nvcc=yes; fi
with_nvshmem=no
if [ "$has_nvcc" = yes ] && [ "${JAX_EP_ENABLE_NVSHMEM:-AUTO}" != "OFF" ]; then
  with_nvshmem=yes
fi
deps_hash=$(digest scripts/setup.sh pyproject.toml "$(python -VV)" "nvshmem=$with_nvshmem")
if up_to_date .setup-deps "$deps_hash"; then
  echo "setup: the installs are up to date"
else
  rm -f .venv/.setup-deps .venv/.setup-build
  python -m pip install -q --upgrade pip
  # Pinned to the GPU machine's versions; build tools installed up front so the extension builds
  # without build isolation (its CMake reads the FFI headers from the installed jaxlib). The
  # test tools are pyproject.toml's `test` extra.
  python -m pip install -q "jax==0.11.2" "jaxlib==0.11.2" "scikit-build-core>=0.10" \
    "nanobind>=2.4" cmake ninja numpy pytest pytest-xdist absl-py "flax>=0.12" optax flatbuffers
  # NVSHMEM (the network transport's engine), the GPU machine's version: with nvcc present the
  # build compiles and links jax_ep's NVSHMEM module against this wheel (JAX_EP_ENABLE_NVSHMEM).
  if [ "$with_nvshmem" = yes ]; then
    python -m pip install -q "nvidia-nvshmem-cu13==3.4.5"
  fi
  echo "$deps_hash" > .venv/.setup-deps
fi

# AUTO builds the extension exactly where nvcc is, as ON does: one stamp for both.
cuda_mode=${JAX_EP_ENABLE_CUDA:-AUTO}
if [ "$cuda_mode" = AUTO ]; then
  cuda_mode=$([ "$has_nvcc" = yes ] && echo ON || echo OFF)
fi
jax_ep_files=$(cd jax_ep && find . -type f -not -path '*/__pycache__/*' | LC_ALL=C sort)
build_hash=$(digest "$deps_hash" CMakeLists.txt ffi "$jax_ep_files" \
                    "$(grep -h __version__ jax_ep/__init__.py)" \
                    "cuda=$cuda_mode" "nvshmem=${JAX_EP_ENABLE_NVSHMEM:-AUTO}" \
                    "cmake_args=${CMAKE_ARGS:-}")
if up_to_date .setup-build "$build_hash" &&
   python -c 'import importlib.metadata as m; m.version("jax_ep")' 2>/dev/null; then
  echo "setup: jax_ep's build is up to date"
  exit 0
fi
rm -f .venv/.setup-build
start=$(date +%s)
python -m pip install -q --no-build-isolation --no-deps -e .
echo "$build_hash" > .venv/.setup-build
echo "setup: jax_ep built and installed in $(( $(date +%s) - start )) s" \
     "(CUDA extension: $(python -c 'import jax_ep._native.ffi as f; print("yes" if f.extension() else "no")')," \
     "NVSHMEM module: $(python -c 'from jax_ep.backends import nvshmem; print("yes" if nvshmem.available() else "no")'))"
