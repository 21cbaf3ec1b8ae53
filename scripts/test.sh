#!/usr/bin/env bash
# The project's test command: set up (venv, install, build), then run the whole suite on the CPU
# (8 host devices; GPU-only tests are skipped there and run on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest tests -q "$@"
