#!/usr/bin/env bash
# Creates .venv (Python >= 3.12), installs the pinned JAX and the test extras, and builds jax_ep
# (the CUDA extension too when nvcc is found; JAX_EP_ENABLE_CUDA=OFF skips it). Idempotent.
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

if [ ! -x .venv/bin/python ]; then
  "$(pick_python)" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Pinned to the GPU machine's versions; build tools installed up front so the extension builds
# without build isolation (its CMake reads the FFI headers from the installed jaxlib).
python -m pip install -q "jax==0.11.2" "jaxlib==0.11.2" "scikit-build-core>=0.10" "nanobind>=2.4" \
  cmake ninja numpy pytest absl-py "flax>=0.12" optax flatbuffers
# NVSHMEM (the network transport's engine), the GPU machine's version: with nvcc present the
# build compiles and links jax_ep's NVSHMEM module against this wheel (JAX_EP_ENABLE_NVSHMEM).
if command -v nvcc >/dev/null 2>&1 && [ "${JAX_EP_ENABLE_NVSHMEM:-AUTO}" != "OFF" ]; then
  python -m pip install -q "nvidia-nvshmem-cu13==3.4.5"
fi
start=$(date +%s)
python -m pip install -q --no-build-isolation --no-deps -e .
echo "setup: jax_ep built and installed in $(( $(date +%s) - start )) s" \
     "(CUDA extension: $(python -c 'import jax_ep._native.ffi as f; print("yes" if f.extension() else "no")')," \
     "NVSHMEM module: $(python -c 'from jax_ep.backends import nvshmem; print("yes" if nvshmem.available() else "no")'))"
