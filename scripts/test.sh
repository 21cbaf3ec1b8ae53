#!/usr/bin/env bash
# The project's test command: set up (venv, install, build; skipped when nothing they depend on
# changed, see scripts/setup.sh), then run the whole suite on the CPU (8 host devices; GPU-only
# tests are skipped there and run on a GPU machine), on one pytest-xdist worker per CPU core
# (JAX_EP_TEST_WORKERS=N for N workers; 0 runs every test in one process, the default where
# there is an NVIDIA GPU, which the workers would share). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
workers=${JAX_EP_TEST_WORKERS:-}
if [ -z "$workers" ]; then
  if compgen -G "/dev/nvidia[0-9]*" >/dev/null; then workers=0; else workers=auto; fi
fi
exec python -m pytest tests -q -n "$workers" --dist worksteal "$@"
