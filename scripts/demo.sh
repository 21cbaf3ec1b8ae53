#!/usr/bin/env bash
# The project's main job: set up, then train a small MoE layer with expert parallelism over every
# device found, checked against the dense model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m jax_ep.demo "$@"
