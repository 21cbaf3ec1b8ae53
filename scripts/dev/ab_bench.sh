#!/usr/bin/env bash
# A/B of one benchmark across source trees in one device call: trees staged beside the working
# tree with scripts/dev/stage_branch.sh (each with its built extension), run interleaved ROUNDS
# times (default 2: A B A B), so drift of the GPU shows up as drift, not as a difference.
#   bash scripts/dev/ab_bench.sh local "--tokens 128 4096 --backends cuda --timing single batch" \
#     main=. ptrs=.devcarry/ptrs
#   bash scripts/dev/ab_bench.sh intranode8 "--no-breakdown --backends cuda" main=. own=.devcarry/own
#   bash scripts/dev/ab_bench.sh gpus2 "--no-breakdown --backends cuda" \
#     one=.devcarry/slots "two=.devcarry/slots@--comm-slots 2"
# BENCH: `local` (benchmarks/bench_local.py, one GPU), `intranodeN` (benchmarks/
# bench_intranode.py, N ranks emulated on one GPU under CUDA MPS) or `gpusN` (the same with one
# process per GPU on GPUs 0..N-1). NAME=TREE@EXTRA adds EXTRA to ARGS for that tree only.
# Every run's rows go to stdout as they come; all logs go to $OUT/ab.log and all records to
# $OUT/ab.jsonl (two files, whatever the number of runs). A tree's commit comes from the
# .jax_ep_commit that stage_branch.sh writes, else from its own .git, else "unknown".
set -uo pipefail
cd "$(dirname "$0")/../.."
bench=${1:?usage: ab_bench.sh BENCH "ARGS" NAME=TREE [NAME=TREE ...]}
args=${2?usage: ab_bench.sh BENCH "ARGS" NAME=TREE [NAME=TREE ...]}
shift 2
[ $# -ge 1 ] || { echo "ab_bench.sh: give at least one NAME=TREE" >&2; exit 2; }
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
root=$PWD
case $bench in
  local) script=benchmarks/bench_local.py; launch=() ;;
  intranode[0-9]*)
    script=benchmarks/bench_intranode.py
    launch=(python3 -m jax_ep.launch -n "${bench#intranode}" --share-gpu --grace 20 --timeout 280
            --) ;;
  gpus[0-9]*)
    script=benchmarks/bench_intranode.py
    n=${bench#gpus}
    export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1)))
    launch=(python3 -m jax_ep.launch -n "$n" --grace 20 --timeout 280 --) ;;
  *) echo "ab_bench.sh: BENCH must be local, intranodeN or gpusN, got $bench" >&2; exit 2 ;;
esac

# (A staged tree sits inside this repository: git there would name this checkout's commit.
# The GPU machine's copy of this checkout may carry stale git metadata, so its commit comes from
# $JAX_EP_COMMIT when that is set, as in gpu_round.sh.)
commit_of() {
  if [ -f "$1/.jax_ep_commit" ]; then cat "$1/.jax_ep_commit"
  elif [ "$1" = "$root" ] && [ -n "${JAX_EP_COMMIT:-}" ]; then echo "$JAX_EP_COMMIT"
  elif [ -e "$1/.git" ]; then git -C "$1" rev-parse --short HEAD 2>/dev/null || echo unknown
  else echo unknown; fi
}

for round in $(seq 1 "${ROUNDS:-2}"); do
  for pair in "$@"; do
    name=${pair%%=*}; spec=${pair#*=}; extra=
    case $spec in *@*) extra=${spec#*@}; spec=${spec%%@*} ;; esac
    tree=$(cd "$root" && cd "$spec" && pwd)
    records=ab_${name}_${round}.jsonl
    echo "== $name, round $round ($(commit_of "$tree")${extra:+, $extra}, $(date +%T))" \
      | tee -a "$OUT/ab.log"
    # Rows of the table, and process 0's under the launcher; the rest stays in the log.
    (cd "$tree" && rm -f "benchmarks/results/$records" &&
     PYTHONPATH=$tree JAX_EP_COMMIT=$(commit_of "$tree") timeout 300 \
       "${launch[@]}" python3 "$script" $args $extra --out "$records") 2>&1 \
      | tee -a "$OUT/ab.log" | grep -E "^(\[0\] )?(dispatch|combine|layout) "
    cat "$tree/benchmarks/results/$records" >> "$OUT/ab.jsonl" 2>/dev/null
    rm -f "$tree/benchmarks/results/$records"
  done
done
