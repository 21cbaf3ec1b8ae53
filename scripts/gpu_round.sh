#!/usr/bin/env bash
# One build-check-benchmark round on a GPU machine, with the extension built elsewhere and
# carried in as jax_ep/_jax_ep_ffi*.so. Logs and results go to $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
step device; nvidia-smi -L
python3 -c "import jax, jax_ep._ffi as f; print(jax.__version__, jax.devices(), 'cuda extension:', f.cuda_available())"
step cuda test suite
timeout 240 python3 -m pytest tests/test_cuda_local.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.log" | tail -15
step benchmark
timeout 240 python3 benchmarks/bench_local.py --out local.jsonl 2>&1 | tee "$OUT/bench.log" | tail -30
cp benchmarks/results/local.jsonl "$OUT/" 2>/dev/null
step API and layer tests on the GPU
timeout 120 python3 -m pytest tests/test_api.py tests/test_layer.py -q -x -p no:cacheprovider 2>&1 | tail -4
step main job on the GPU
timeout 60 python3 -m jax_ep.demo --steps 5 2>&1 | tail -12
step compute-sanitizer memcheck
timeout 100 compute-sanitizer --tool memcheck --kernel-name kns=jax_ep \
  --print-limit 20 python3 scripts/sanitize_local.py 2>&1 | tail -6
