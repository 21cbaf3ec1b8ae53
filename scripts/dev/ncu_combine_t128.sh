#!/usr/bin/env bash
# Side-by-side ncu report of the T=128 combine: our local combine and XLA's fused gather + weighted
# sum (the reference backend), each profiled once with the full section set (memory workload,
# warp states, source counters), printed as text into $OUT/ncu_combine_t128.txt (one file).
#   OUT=... bash scripts/dev/ncu_combine_t128.sh            (on the GPU machine; ~1-2 min)
# Clocks are left as they are (--clock-control none): the benchmark runs at the GPU's own clocks.
# NCU_ARGS adds ncu options, e.g. NCU_ARGS="--cache-control none" keeps the caches as the
# previous run left them (ncu flushes them before each pass by default).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
report="$OUT/ncu_combine_t128.txt"
: > "$report"
for backend in cuda reference; do
  # Only the combine's kernels: profile_local_op.py brackets its runs with the profiler range
  # (the input conversions and the dispatch that makes the handle run outside it).
  echo "=== $backend" >> "$report"
  PYTHONPATH=$PWD timeout 240 ncu --clock-control none ${NCU_ARGS:-} --set full --profile-from-start off \
    -c 1 --print-details all python3 scripts/profile_local_op.py --op combine \
    --backend "$backend" --runs 2 --profiler-range 2>&1 | grep -vE "^==PROF==|^\s*$" \
    >> "$report"
done
grep -E "^===|Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Achieved Occupancy|Registers Per" \
  "$report"
