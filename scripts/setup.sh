#!/usr/bin/env bash
# Creates .venv (Python >= 3.12), installs the pinned JAX and the test extras, and builds jax_ep.
# The CUDA extension (and NVSHMEM, the multi-host transport's engine) is built only where it can
# run or is asked for, and the script says which it did:
#   JAX_EP_ENABLE_CUDA=AUTO (default): built where there is an NVIDIA GPU and nvcc;
#   JAX_EP_ENABLE_CUDA=ON:   built wherever nvcc is (CI sets this to compile every CUDA source
#                            on machines without a GPU, where JAX's CUDA PJRT plugin is
#                            installed apart, in .venv/cuda-aot, to compile for an H200 without
#                            one); fails without nvcc;
#   JAX_EP_ENABLE_CUDA=OFF:  never; nothing CUDA is installed (no NVSHMEM wheel).
# JAX_EP_ENABLE_NVSHMEM=OFF leaves NVSHMEM out of a CUDA build. Idempotent, and quick when
# nothing changed: each step records a hash of what it depends on in .venv/ and is skipped
# while that hash is unchanged (JAX_EP_SETUP_FORCE=1 redoes every step):
#   the installs: this script, pyproject.toml, Python's version, whether CUDA is built,
#                 NVSHMEM's switch;
#   the build:    the installs' hash, CMakeLists.txt, the contents of ffi/, the names of the files
#                 under jax_ep/ (the editable install maps each module to its file; edits to
#                 Python files need nothing), the version, the CUDA and NVSHMEM choices and
#                 CMAKE_ARGS.
# A fresh clone has no .venv and so does every step. A step that fails leaves its stamp out, so
# the next run redoes it. Rebuilding after a change to ffi/ recompiles only what changed (the
# build directory is kept: build/). `--dry-run` prints the CUDA choice and changes nothing.
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

has_nvcc=no
if command -v nvcc >/dev/null 2>&1; then has_nvcc=yes; fi
has_gpu=no
if compgen -G "/dev/nvidia[0-9]*" >/dev/null ||
   { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
  has_gpu=yes
fi
# The build gets an explicit ON or OFF: CMake's own AUTO would compile wherever nvcc is, GPU or
# not (minutes of nvcc for an extension that cannot run there).
cuda_mode=$(echo "${JAX_EP_ENABLE_CUDA:-AUTO}" | tr '[:lower:]' '[:upper:]')
case "$cuda_mode" in
  ON)  cuda_why="JAX_EP_ENABLE_CUDA=ON" ;;
  OFF) cuda_why="JAX_EP_ENABLE_CUDA=OFF" ;;
  AUTO)
    if [ "$has_gpu" = yes ] && [ "$has_nvcc" = yes ]; then
      cuda_mode=ON; cuda_why="an NVIDIA GPU and nvcc found"
    elif [ "$has_gpu" = yes ]; then
      cuda_mode=OFF; cuda_why="an NVIDIA GPU but no nvcc on PATH"
    elif [ "$has_nvcc" = yes ]; then
      cuda_mode=OFF; cuda_why="nvcc but no NVIDIA GPU; JAX_EP_ENABLE_CUDA=ON builds it anyway"
    else
      cuda_mode=OFF; cuda_why="no NVIDIA GPU, no nvcc"
    fi ;;
  *) echo "setup: JAX_EP_ENABLE_CUDA must be AUTO, ON or OFF, got '$JAX_EP_ENABLE_CUDA'" >&2
     exit 1 ;;
esac
with_nvshmem=no
if [ "$cuda_mode" = ON ] && [ "${JAX_EP_ENABLE_NVSHMEM:-AUTO}" != "OFF" ]; then
  with_nvshmem=yes
fi
nvshmem_mode=$([ "$with_nvshmem" = yes ] && echo "${JAX_EP_ENABLE_NVSHMEM:-AUTO}" || echo OFF)
if [ "$cuda_mode" = ON ]; then
  echo "setup: building the CUDA extension ($cuda_why; NVSHMEM module: $with_nvshmem)"
else
  echo "setup: reference backend only, no CUDA build ($cuda_why)"
fi
if [ "${1:-}" = --dry-run ]; then exit 0; fi  # the choice alone, nothing installed

if [ ! -x .venv/bin/python ]; then
  "$(pick_python)" -m venv .venv
fi
. .venv/bin/activate

deps_hash=$(digest scripts/setup.sh pyproject.toml "$(python -VV)" "cuda=$cuda_mode" \
                   "nvshmem=$with_nvshmem")
if up_to_date .setup-deps "$deps_hash"; then
  echo "setup: the installs are up to date"
else
  rm -f .venv/.setup-deps .venv/.setup-build
  python -m pip install -q --upgrade pip
  # Pinned to the GPU machine's versions; build tools installed up front so the extension builds
  # without build isolation (its CMake reads the FFI headers from the installed jaxlib). The
  # test tools are pyproject.toml's `test` extra.
  python -m pip install -q "jax==0.11.2" "jaxlib==0.11.2" "scikit-build-core>=0.10" \
    "nanobind>=2.4" cmake ninja numpy pytest pytest-xdist absl-py "flax>=0.12" optax \
    orbax-checkpoint flatbuffers
  # NVSHMEM (the network transport's engine), the GPU machine's version, for CUDA builds only:
  # the build compiles and links jax_ep's NVSHMEM module against this wheel.
  if [ "$with_nvshmem" = yes ]; then
    python -m pip install -q "nvidia-nvshmem-cu13==3.4.5"
  fi
  # JAX's CUDA PJRT plugin at the jaxlib's version, for CUDA builds on machines without a GPU:
  # it compiles programs for a compile-only H200 (jax_ep.testing.aot, tests/test_hopper_aot.py).
  # Installed apart (.venv/cuda-aot, put on PYTHONPATH by the processes that compile), so that
  # JAX in .venv does not try to start a GPU backend; without its CUDA libraries, which only a
  # GPU run needs.
  if [ "$cuda_mode" = ON ] && [ "$has_gpu" = no ]; then
    rm -rf .venv/cuda-aot
    python -m pip install -q --no-deps --target .venv/cuda-aot "jax-cuda13-plugin==0.11.2" \
      "jax-cuda13-pjrt==0.11.2"
  fi
  echo "$deps_hash" > .venv/.setup-deps
fi

jax_ep_files=$(cd jax_ep && find . -type f -not -path '*/__pycache__/*' | LC_ALL=C sort)
build_hash=$(digest "$deps_hash" CMakeLists.txt ffi "$jax_ep_files" \
                    "$(grep -h __version__ jax_ep/__init__.py)" \
                    "cuda=$cuda_mode" "nvshmem=$nvshmem_mode" \
                    "cmake_args=${CMAKE_ARGS:-}")
if up_to_date .setup-build "$build_hash" &&
   python -c 'import importlib.metadata as m; m.version("jax_ep")' 2>/dev/null; then
  echo "setup: jax_ep's build is up to date"
  exit 0
fi
rm -f .venv/.setup-build
start=$(date +%s)
JAX_EP_ENABLE_CUDA=$cuda_mode JAX_EP_ENABLE_NVSHMEM=$nvshmem_mode \
  python -m pip install -q --no-build-isolation --no-deps -e .
echo "$build_hash" > .venv/.setup-build
echo "setup: jax_ep built and installed in $(( $(date +%s) - start )) s" \
     "(CUDA extension: $(python -c 'import jax_ep._native.ffi as f; print("yes" if f.extension() else "no")')," \
     "NVSHMEM module: $(python -c 'from jax_ep.backends import nvshmem; print("yes" if nvshmem.available() else "no")'))"
