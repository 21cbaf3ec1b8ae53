#!/usr/bin/env bash
# One build-check-benchmark round on a GPU machine, with the extension built elsewhere and
# carried in as jax_ep/_jax_ep_ffi*.so (and jax_ep/_jax_ep_nvshmem*.so for the nvshmem stage; see
# README). Logs and results go to $OUT (or ./gpu_out).
#   bash scripts/gpu_round.sh local   # one-rank kernels: suite, main job, sanitizer, benchmark
#   bash scripts/gpu_round.sh peer    # the peer transport emulated on one GPU: suites,
#                                        # faults, sanitizer, bench
#   bash scripts/gpu_round.sh smoke   # peer transport: pointer table + one small test at N=2
#   stages of `peer`, one by one: faults, peer2, peer4, peer8, sanitize, bench (BENCH_RANKS="2 4 8",
#   BENCH_ARGS="--num-sms 48 ..." passed to bench_intranode.py)
#   bash scripts/gpu_round.sh multi   # several GPUs: multi_suites + multi_bench per R
#                                     # in MULTI_RANKS, one process per GPU (seeing all GPUs,
#                                     # then only its own: suites) and one for all;
#                                     # MULTI_SMS="48 96": extra cuda runs at those SM budgets
#                                     # (MULTI_SEND_RECV=1: also XLA's send/recv fallback;
#                                     # MULTI_PASSES="per_gpu isolated one_process": the
#                                     # suites' process models, to split them over calls)
#   bash scripts/gpu_round.sh layers  # the layer chain (bench_layers.py): identity and SwiGLU
#                                     # experts, forward and forward + backward, the default
#                                     # capacity beside buffer_factor=1.1: R=1, then
#                                     # LAYER_RANKS="2 8" emulated (LAYER_ARGS passed to it)
#   bash scripts/gpu_round.sh gemm    # the grouped GEMM and the whole MoE layer (bench_layer.py),
#                                     # the GPU grouped-matmul tests (GEMM_ARGS="--tune": the
#                                     # tile sweep)
#   bash scripts/gpu_round.sh gemmtune  # bench_layer.py --tune at GEMMTUNE_SHAPES (default
#                                     # deepseek_v3; a minute or two a shape): every forward and
#                                     # weight-gradient tile set, the fastest forward's table entry
#                                     # (GEMMTUNE_PARTS: bench_layer.py's --tune parts, e.g.
#                                     # weight_grad_runs)
#   bash scripts/gpu_round.sh experts # the fused expert MLP: its GPU tests at the five model
#                                     # shapes, bench_expert_mlp.py (expert_mlp against three
#                                     # dense GEMMs, buffers 2x and 8x the rows) and
#                                     # bench_layer.py's grouped_matmul op at the five shapes
#                                     # (EXPERT_ARGS passed to bench_expert_mlp.py);
#                                     # expertsbench: the benchmarks alone; expertsgemm: the
#                                     # grouped_matmul op alone
#   bash scripts/gpu_round.sh layer   # the MoE layer and the NNX module train at model shapes
#                                     # against the dense model: R=1, then LAYER_TEST_RANKS="2 4"
#                                     # emulated
#   bash scripts/gpu_round.sh lowlatency  # the low-latency pair: its suites at R=1 and
#                                     # LL_RANKS="2 4 8" emulated, compute-sanitizer memcheck and
#                                     # racecheck at R=2, bench_low_latency.py at R=1 and
#                                     # LL_BENCH_RANKS="8" (LL_BENCH_ARGS passed to it);
#                                     # its stages one by one: ll1, ll2, ll4, ll8 (the
#                                     # suites), llown, llsanitize, llbench
#   bash scripts/gpu_round.sh nvshmem  # NVSHMEM joined by unique id, a put-with-signal ring at
#                                     # 2, 4 and 8 PEs on the GPU (tests/test_nvshmem.py)
#   bash scripts/gpu_round.sh network  # the network transport between virtual hosts (8 ranks as
#                                     # 2 x 4 and 4 x 2), command buffers, a skipped call,
#                                     # memcheck (NET_HOSTS, NET_BENCH=1 adds the benchmark);
#                                     # netsanitize: the memcheck alone; netrail: its rail
#                                     # exchange part alone
#   bash scripts/gpu_round.sh netbench  # the high-throughput ops across 2 virtual hosts beside
#                                     # one host, 8 ranks: layer chain (netlayers), per op (netops)
#   bash scripts/gpu_round.sh fp8bench  # the FP8 dispatch beside the bf16 one at 8 ranks
#                                     # emulated, T=4096, H=7168, top-8 of 256 (FP8_BENCH_ARGS;
#                                     # T=2048 on a GPU under 100 GiB, FP8_BENCH_TOKENS), the
#                                     # rows quantised by the dispatch and by the caller, then
#                                     # the identity layer chain with each wire, its kernels
#   bash scripts/gpu_round.sh example   # examples/moe_transformer.py on one GPU: defaults, the
#                                     # compilation cache filled then read, 2 micro-batches on
#                                     # jax_ep's own stream
#   bash scripts/gpu_round.sh examplecompile  # where the example's first step goes: XLA's
#                                     # own timers (scripts/xla_pass_times.py), with XLA's
#                                     # Triton GEMMs and without, and with the kernels'
#                                     # modules as Mosaic GPU makes them
#   bash scripts/gpu_round.sh fp8       # the experts in FP8: bench_fp8_gemm.py, the layer's
#                                     # precisions (bench_layer.py), the example with --fp8
#   bash scripts/gpu_round.sh fp8example  # the example in bf16 and with --fp8 alone
#   bash scripts/gpu_round.sh fp8kernels  # the FP8 MLP's gated and input-gradient kernels
#   bash scripts/gpu_round.sh fp8layer  # the layer in both precisions at DeepSeek-V3's EP=8
#                                     # rank, each pass's longest kernels (--breakdown)
#   bash scripts/gpu_round.sh overlap   # the ops beside the experts (comm_stream=1, jax_ep): hidden
#                                     # fraction at one rank (bench_overlap.py), the SwiGLU chain
#                                     # with 1 and 2 micro-batches at 1 and 8 ranks
#   bash scripts/gpu_round.sh llncu    # ncu of the low-latency kernels at one rank (T=128, fp8)
#   bash scripts/gpu_round.sh fp8ncu   # ncu of the FP8 layer's backward kernels off the
#                                     # products (column copies, activation gradient) and its
#                                     # weight gradients, DeepSeek-V3's EP=8 rank: time, DRAM
#                                     # throughput, occupancy and what limits it
#   bash scripts/gpu_round.sh gemmncu  # ncu of the bf16 grouped GEMM's kernels (forward, input
#                                     # and weight gradients) at the five model shapes: time,
#                                     # tensor pipe, SM, L2 and DRAM throughput, L2 hit rate
#                                     # (GEMMNCU_ARGS passed to bench_layer.py)
#   bash scripts/gpu_round.sh overlapncu  # ncu of the expert kernels and the one-rank ops of
#                                     # the overlap pipeline and the two halves: time, SM and
#                                     # DRAM throughput, clock (bench_overlap.py)
#   bash scripts/gpu_round.sh slab     # the experts on the low-latency slabs: tests, benchmark
#   bash scripts/gpu_round.sh check     # every GPU suite, nothing else: check1 ... check9, each
#                                     # part under 10 minutes on one H200 (below); what a
#                                     # commit's records leave of it: scripts/check_status.py
#   bash scripts/gpu_round.sh all
# Several stages may be given in one call (one device round): gpu_round.sh local smoke
# They run in this file's order, not the command line's: the check's parts and `step:` names
# first, then the other stages; with DEADLINE_S, a stage given after check steps gets what
# they leave.
# Set JAX_EP_COMMIT=<hash> in the command: the GPU machine's copy may carry stale git metadata,
# and the benchmark and suite records name the commit they measured.
#
# Every test run goes through scripts/gpu_suite.py: JAX_EP_REQUIRE_GPU=1 (a missing GPU,
# extension, NVSHMEM module or Hopper chip fails instead of skipping), a junit report per process
# under $OUT/junit/, the whole output under $OUT/logs/, and one `gpu_suite` record per run in
# $OUT/gpu_suites.jsonl (append those of a commit's full check to
# benchmarks/results/gpu_suites.jsonl). The round exits non-zero if any suite failed, and a
# summary of every suite closes it.
#   check1  one rank: the cuda suite (jax_ep's own stream included), the input checks,
#           memcheck of a one-rank round
#   check2  one rank: the grouped GEMM, the slab and group-id tests, the NVSHMEM ring, the FP8
#           MLP and layer
#   check3  the peer transport's suite in one process (faults, command buffers), at 2 and 4
#           ranks emulated
#   check4  the peer transport's suite at 8 ranks; memcheck and racecheck of both modes (and of
#           the fp8 dispatch) at 2
#   check5  the layer suite on the cuda backend (model shapes included) at 1 and 2 ranks
#   check6  the layer at 4 ranks; the network tests that start their own ranks
#   check7  the network transport at 2 x 4 and 4 x 2 virtual hosts, memcheck of its kernels
#   check8  the fused bf16 expert MLP at the five model shapes: as called, then under vmap and
#           jax.checkpoint
#   check9  the FP8 kernels at the model shapes (weight gradients included)
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=" ${*:-all} "
has() { [[ "$STAGES" == *" $1 "* ]] || [[ "$STAGES" == *" all "* ]]; }
# `check` is check1 ... check9.
checks() { has check || [[ "$STAGES" == *" $1 "* ]]; }
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
# suite [gpu_suite.py options] -- command: one suite, recorded; a failure fails the round.
status=0
ROUND_START=$(date +%s)
suite() {
  if [ -n "${CHECK_DRY_RUN:-}" ]; then echo "SUITE $(printf '%q ' "$@")"; return; fi
  local left=""
  if [ -n "${DEADLINE_S:-}" ]; then
    left=$((DEADLINE_S - ($(date +%s) - ROUND_START)))
    if [ "$left" -lt 60 ]; then
      echo "NOT RUN (the round's deadline): gpu_suite.py $*"; status=1; return
    fi
  fi
  python3 scripts/gpu_suite.py --out "$OUT" ${left:+--max-seconds $((left - 10))} "$@" || status=1
}
# A benchmark or other command whose exit status counts (its output piped elsewhere); with its
# log, a variant the benchmark caught and reported (": failed: ") fails the round too.
counts() {
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then echo "FAILED: $1 (exit $rc)"; status=1; return; fi
  if [ -n "${2:-}" ] && grep -q ": failed: " "$2"; then
    echo "FAILED: $1: $(grep -c ": failed: " "$2") variant(s) failed (see $2)"; status=1
  fi
}
# The seconds a benchmark may take: $1, or what the round's deadline leaves (less 10 s); none
# (exit 1, the step skipped and the round failed) under 60.
bench_time() {
  local t=$1
  if [ -n "${DEADLINE_S:-}" ]; then
    local left=$((DEADLINE_S - ($(date +%s) - ROUND_START) - 10))
    [ "$left" -lt "$t" ] && t=$left
  fi
  if [ "$t" -lt 60 ]; then echo "NOT RUN (the round's deadline)" >&2; status=1; return 1; fi
  echo "$t"
}
PYTEST="python3 -m pytest -q -rfE -p no:cacheprovider"
# The distributed runtime logs glog warnings as processes exit ("W1129 ... WatchTasksAsync
# failed ... CANCELLED", "UNAVAILABLE: failed to connect"): they are not test results, and they
# match "failed", so they go before any grep for pass/fail lines.
noise="(^|\] )[WI][0-9]{4} [0-9:.]+ |GRPC error information|UNAVAILABLE|CANCELLED"
noise="$noise|grpc_util|Source Location|^\[[0-9]+\] *$"
drop_noise() { grep -v -E "$noise"; }
# This round's records only (bench scripts append): the tracked benchmarks/results/*.jsonl keep
# the history, and are extended here by hand from $OUT.
rm -f benchmarks/results/gpu_round_local.jsonl benchmarks/results/gpu_round_intranode.jsonl \
  benchmarks/results/gpu_round_layers.jsonl benchmarks/results/gpu_round_layer.jsonl \
  benchmarks/results/gpu_round_low_latency.jsonl benchmarks/results/gpu_round_slab_mlp.jsonl \
  benchmarks/results/gpu_round_expert_mlp.jsonl benchmarks/results/gpu_round_expert_gemm.jsonl \
  benchmarks/results/gpu_round_fp8_gemm.jsonl benchmarks/results/gpu_round_fp8_layer.jsonl \
  benchmarks/results/gpu_round_overlap.jsonl
if [ -z "${CHECK_DRY_RUN:-}" ]; then
  step device; nvidia-smi -L
  python3 -c "import jax, jax_ep._native.ffi as f; print(jax.__version__, jax.devices(), 'cuda extension:', f.cuda_available(), f.why_unavailable() or '')"
fi

# ---------------------------------------------------------------------------------- the suites
# One function per suite (or family), shared by the check parts and the named stages below.
# The cuda suite at one rank (the shared suite again on comm_stream=1, the stream's own
# tests). Its ~390 programs are small and their compilation is CPU work, so GPU_WORKERS
# pytest-xdist workers (default 4; 0: one process) share the GPU, each allocating as it goes
# instead of taking 75 % up front.
local_suite() {
  local workers=${GPU_WORKERS:-4}
  python3 -c "import xdist" 2>/dev/null || workers=0
  if [ "$workers" -gt 0 ]; then
    XLA_PYTHON_CLIENT_PREALLOCATE=false suite --timeout 500 -- $PYTEST -n "$workers" \
      tests/test_cuda_local.py tests/test_comm_stream.py
  else
    suite --timeout 500 -- $PYTEST tests/test_cuda_local.py tests/test_comm_stream.py
  fi
}
# jax_ep's own stream alone (its partition of the SMs, its ops against the compute stream's).
comm_stream_suite() { suite --timeout 200 -- $PYTEST tests/test_comm_stream.py -m gpu; }
# The public functions' input checks on the cuda backend at one rank, and the FP8 dispatch's
# choice of backend on a GPU.
inputs_suite() {
  suite --timeout 300 -- $PYTEST tests/test_input_checks.py tests/test_fp8_dispatch.py -m gpu
}
gemm_suite() { suite --timeout 300 -- $PYTEST tests/test_grouped_matmul.py tests/test_routing.py -m gpu; }
# The fused expert MLP at the five model shapes (DeepSeek-V3's weights and gradients take most
# of the GPU), in two runs with their own time limits: as called (and the same bits twice),
# then under vmap and jax.checkpoint (the models' shapes twice more over).
fused_suite() {
  XLA_PYTHON_CLIENT_MEM_FRACTION=.92 suite --timeout 400 -- $PYTEST tests/test_fused_expert_mlp.py \
    -m gpu -k "plain or every_activation or same_bits" --durations 10
}
fused_wrapped_suite() {
  XLA_PYTHON_CLIENT_MEM_FRACTION=.92 suite --timeout 500 -- $PYTEST tests/test_fused_expert_mlp.py \
    -m gpu -k "vmap or checkpoint" --durations 10
}
# The FP8 kernels at the model shapes (weight gradients included), then the FP8 MLP and layer:
# two steps, each under half of a 10-minute call.
fp8_kernels_suite() {
  XLA_PYTHON_CLIENT_MEM_FRACTION=.92 suite --timeout 500 -- $PYTEST tests/test_fp8_kernels.py \
    -m gpu
}
fp8_mlp_suite() {
  XLA_PYTHON_CLIENT_MEM_FRACTION=.92 suite --timeout 300 -- $PYTEST tests/test_fp8_experts.py \
    -m gpu
}
experts_suite() { fp8_kernels_suite; fp8_mlp_suite; fused_suite; fused_wrapped_suite; }
# The layer suite's GPU tests: its tests on the cuda backend and the model shapes, and the
# micro-batched layer against the unsplit one.
layer_suite() {  # $1: ranks (one process takes most of the GPU: DeepSeek-V3's dense twin)
  if [ "$1" = 1 ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=.92 suite --timeout 460 -- $PYTEST tests/test_layer.py \
      tests/test_micro_batches.py -m gpu
  else
    # A call's whole time: at R=1 alone the suite took 268 s on an H100 machine, and R=2 and 4
    # run some twenty tests more (those that need several devices) beside the model shapes.
    suite --ranks "$1" --timeout 570 -- $PYTEST tests/test_layer.py \
      tests/test_micro_batches.py -m gpu
  fi
}
slab_suite() {
  suite --timeout 300 -- $PYTEST tests/test_slab_mlp.py tests/test_group_ids.py -m gpu
}
nvshmem_suite() { suite --timeout 400 -- $PYTEST tests/test_nvshmem.py; }
local_memcheck() {
  suite --sanitizer memcheck --kernels kns=jax_ep --timeout 200 -- python3 scripts/sanitize_local.py
}
# The peer transport's suite in one process: the pointer table, the fault cases and the decode
# step in command buffers, each starting the ranks it needs.
peer_own_suite() { suite --timeout 400 -- $PYTEST tests/test_cuda_peer.py; }
peer_suite() {  # $1: ranks; PYTEST_K narrows it (a count of a narrowed run is not a check)
  suite --ranks "$1" --timeout $((240 + 40 * $1)) -- $PYTEST tests/test_cuda_peer.py \
    -o faulthandler_timeout=200 ${PYTEST_K:+-k "$PYTEST_K"}
}
peer_sanitize() {  # the plain rows, then the fp8 dispatch's (quantised and given)
  for tool in memcheck racecheck; do
    suite --ranks 2 --sanitizer $tool --kernels kns=jax_ep --timeout 240 -- $PYTEST \
      tests/test_cuda_peer.py -k "test_dispatch_combine_uniform and 128-3-8"
    suite --ranks 2 --sanitizer $tool --kernels kns=jax_ep --timeout 240 -- $PYTEST \
      tests/test_cuda_peer.py -k "FP8Dispatch and (test_rows_and_scales or caller) and UE8M0"
  done
}
low_latency_sanitize() {
  for tool in memcheck racecheck; do
    suite --ranks 2 --sanitizer $tool --kernels kns=low_latency --timeout 240 -- $PYTEST \
      tests/test_cuda_peer.py -k "LowLatency and test_roundtrip and uniform and 7"
  done
}
# Eight processes compile the layer's programs side by side on the machine's CPU, so the suite's
# time follows that CPU more than the GPU; its limit leaves room for the slower machines.
network_suite() {  # $1: virtual hosts of 8 ranks
  suite --ranks 8 --virtual-hosts "$1" --timeout ${NET_SUITE_TIMEOUT:-540} -- $PYTEST \
    tests/test_cuda_network.py ${NET_PYTEST_ARGS:-}
}
# The tests that start their own ranks (command buffers, a peer that skips the call).
network_own_suite() { suite --timeout 360 -- $PYTEST tests/test_cuda_network.py; }
network_memcheck() {
  suite --ranks 2 --virtual-hosts 2 --sanitizer memcheck --kernels kns=Put --timeout 240 -- \
    $PYTEST tests/test_cuda_network.py -k "test_roundtrip and uniform and 7"
}
# The rail exchange: its pack / wait / unpack / finish kernels (namespace rail) and its put
# kernel (RailPutKernel); the filters add up. Under compute-sanitizer (CUDA 13.0) this process
# died in XLA's compile of its first program, with any filter (docs/multihost.md), so one run
# without it first fills a persistent compilation cache that the sanitized run then loads its
# programs from.
rail_memcheck() {
  local rail_k="HighThroughput and test_dispatch_combine_uniform and 128-3-8" cache
  cache=$(mktemp -d)
  if [ -z "${CHECK_DRY_RUN:-}" ]; then
    JAX_COMPILATION_CACHE_DIR=$cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1 JAX_EP_VIRTUAL_HOSTS=2 timeout 150 \
      python3 -m jax_ep.launch -n 2 --share-gpu --grace 10 --timeout 140 -- python3 -m pytest \
      -q -p no:cacheprovider tests/test_cuda_network.py -k "$rail_k" 2>&1 | drop_noise \
      | grep -E " passed| failed" | tail -3
    echo "compilation cache: $(ls "$cache" | wc -l) entries"
  fi
  JAX_COMPILATION_CACHE_DIR=$cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1 suite --ranks 2 --virtual-hosts 2 \
    --sanitizer memcheck --kernels kns=rail kns=RailPut --timeout 240 -- $PYTEST \
    tests/test_cuda_network.py -k "$rail_k"
  rm -rf "$cache"
}

# The check's steps, in order; `check` runs all of them, `checkN` its part, `step:NAME` one step
# (to resume a check cut by a call's time limit); CHECK_DRY_RUN=1 prints each suite's
# gpu_suite.py arguments instead of running it (scripts/check_status.py). DEADLINE_S=S: steps
# that would start after S seconds of the round are not run (and fail it), and each step's
# time is cut to what is left.
# Each step's time is its records' `wall_s` (benchmarks/results/gpu_suites.jsonl), from which
# scripts/check_status.py packs a commit's missing steps into calls. Most of a step is
# compiling, CPU work: the same step has taken up to twice as long on one machine as on
# another of the same GPU (the one-rank suite 222 and 429 s on two H100 machines).
CHECK1="local inputs localmem"
CHECK2="gemm slab nvshmem fp8_mlp"
CHECK3="peer_own peer2 peer4"
CHECK4="peer8 peer_sanitize low_latency_sanitize"
CHECK5="layer1 layer2"
CHECK6="layer4 network_own"
CHECK7="network2 network4 network_memcheck rail_memcheck"
CHECK8="fused fused_wrapped"
CHECK9="fp8_kernels"
run_step() {
  case $1 in
    local) local_suite ;; comm_stream) comm_stream_suite ;; gemm) gemm_suite ;;
    layer1) layer_suite 1 ;; slab) slab_suite ;;
    experts) experts_suite ;; inputs) inputs_suite ;; fp8_kernels) fp8_kernels_suite ;;
    fp8_mlp) fp8_mlp_suite ;;
    fused) fused_suite ;; fused_wrapped) fused_wrapped_suite ;;
    nvshmem) nvshmem_suite ;; localmem) local_memcheck ;;
    peer_own) peer_own_suite ;; peer[248]) peer_suite "${1#peer}" ;;
    peer_sanitize) peer_sanitize ;; low_latency_sanitize) low_latency_sanitize ;;
    layer[24]) layer_suite "${1#layer}" ;;
    network[24]) network_suite "${1#network}" ;; network_own) network_own_suite ;;
    network_memcheck) network_memcheck ;; rail_memcheck) rail_memcheck ;;
    *) echo "unknown check step $1"; status=1 ;;
  esac
}
# Steps that are part of no check (a check's suite in part), run first when named.
for name in comm_stream experts; do
  if [[ "$STAGES" == *" step:$name "* ]]; then step "step: $name"; run_step "$name"; fi
done
n=0
for part in "$CHECK1" "$CHECK2" "$CHECK3" "$CHECK4" "$CHECK5" "$CHECK6" "$CHECK7" \
    "$CHECK8" "$CHECK9"; do
  n=$((n + 1))
  for name in $part; do
    if checks check$n || [[ "$STAGES" == *" step:$name "* ]]; then
      step "check$n: $name"
      run_step "$name"
    fi
  done
done

if has local; then
  step cuda one-rank suite
  local_suite
  step benchmark, one rank
  timeout 300 python3 benchmarks/bench_local.py --timing single batch --out gpu_round_local.jsonl 2>&1 | tee "$OUT/bench_local.log" | tail -60
  counts bench_local.py
  cp benchmarks/results/gpu_round_local.jsonl "$OUT/" 2>/dev/null
  step main job on the GPU
  timeout 60 python3 -m jax_ep.demo --steps 5 2>&1 | tail -12
  counts "jax_ep.demo"
  step compute-sanitizer memcheck, one rank
  local_memcheck
fi

if has smoke; then
  step peer transport smoke: single-process pointer table, then one small case at N=2
  suite --timeout 60 -- $PYTEST tests/test_cuda_peer.py -k pointer_table
  suite --ranks 2 --timeout 150 -- $PYTEST tests/test_cuda_peer.py \
    -k "test_dispatch_combine_uniform"
fi

if has peer || has faults; then
  step peer transport, one process: pointer table and fault cases
  peer_own_suite
fi

for n in 2 4 8; do
  if has peer || has peer$n; then
    step peer transport suite, $n ranks emulated on one GPU
    peer_suite $n
  fi
done

if has peer || has sanitize; then
  step compute-sanitizer memcheck and racecheck, 2 ranks emulated
  peer_sanitize
fi

if has peer || has bench; then
  for n in ${BENCH_RANKS:-2 4 8}; do
    step peer transport benchmark, $n ranks emulated
    timeout 200 python3 -m jax_ep.launch -n $n --share-gpu --grace 20 --timeout 180 -- \
      python3 benchmarks/bench_intranode.py --out gpu_round_intranode.jsonl ${BENCH_ARGS:-} 2>&1 \
      | tee "$OUT/bench_intranode_$n.log" | grep -E "^\[0\] (  |op |dispatch|combine|cuda|wrote)" | tail -40
  done
  cp benchmarks/results/gpu_round_intranode.jsonl "$OUT/" 2>/dev/null
fi

# The FP8 dispatch beside the bf16 one, same inputs, same run: 8 ranks emulated, the standard
# shape (T=4096, H=7168, top-8 of 256); the target is fp8 <= 0.65x plain (FP8_BENCH_ARGS passed
# to bench_intranode.py). Eight processes at T=4096 need more than an 80 GB GPU holds: the steady
# timing's dispatches in one program each keep their receive buffers, and the fp8 chain keeps its
# dequantised rows beside the fp8 ones (5.3 GiB a process). On a GPU of under 100 GiB both
# benchmarks run T=2048 (their records say so), unless FP8_BENCH_TOKENS names the count.
if has fp8bench; then
  gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  fp8_tokens=${FP8_BENCH_TOKENS:-$([ "${gpu_mib:-0}" -ge 100000 ] && echo 4096 || echo 2048)}
  echo "fp8bench: T=$fp8_tokens a rank (the GPU has ${gpu_mib:-?} MiB)"
  step "FP8 dispatch against bf16, 8 ranks emulated, T=$fp8_tokens (bench_intranode.py)"
  t=$(bench_time 400) && timeout $t python3 -m jax_ep.launch -n 8 --share-gpu --grace 20 \
    --timeout $((t - 20)) -- \
    python3 benchmarks/bench_intranode.py --backends cuda --wire-format plain fp8 fp8_ue8m0 \
    --fp8-quantized-by dispatch caller \
    --tokens "$fp8_tokens" --out gpu_round_intranode.jsonl ${FP8_BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench_intranode_fp8.log" | grep -E "^\[0\] (  |op |dispatch|combine|cuda|wrote)" \
    | tail -40
  counts "bench_intranode.py --wire-format" "$OUT/bench_intranode_fp8.log"
  cp benchmarks/results/gpu_round_intranode.jsonl "$OUT/" 2>/dev/null
  # The identity chain with the fp8 wire beside bf16 rows (target: fp8 <= 0.8x plain).
  step "identity layer chain, fp8 wire against bf16 rows, 8 ranks emulated, T=$fp8_tokens"
  t=$(bench_time 300) && timeout $t python3 -m jax_ep.launch -n 8 --share-gpu --grace 20 \
    --timeout $((t - 20)) -- \
    python3 benchmarks/bench_layers.py --backends cuda --wire-formats plain fp8 --breakdown \
    --tokens "$fp8_tokens" --out gpu_round_layers.jsonl 2>&1 | tee "$OUT/bench_layers_fp8.log" \
    | grep -E "^\[0\] " | tail -40
  counts "bench_layers.py --wire-formats" "$OUT/bench_layers_fp8.log"
  cp benchmarks/results/gpu_round_layers.jsonl "$OUT/" 2>/dev/null
fi

# The end-to-end example as a user runs it on one GPU: its defaults (the first step's time: trace,
# lowering, XLA compile and the Mosaic kernels' builds, run), then twice with JAX's persistent
# compilation cache (filled, then read), then two micro-batches on jax_ep's own stream.
if has example; then
  cache=$(mktemp -d)
  for flags in "" "--compilation-cache $cache" "--compilation-cache $cache" \
      "--micro-batches 2 --comm-stream jax_ep"; do
    step "examples/moe_transformer.py --mesh 1x1 $flags"
    t=$(bench_time 240) && timeout $t python3 examples/moe_transformer.py --mesh 1x1 $flags \
      2>&1 | tee -a "$OUT/example.log" \
      | grep -E "^(step    0|step  *[0-9]+0 |loss|mesh|decode|checkpoint|PASSED|FAILED)"
    counts "examples/moe_transformer.py $flags"
  done
  rm -rf "$cache"
fi

# Where the example's first step goes on this machine: XLA's pass, backend and ptxas timers of
# its training step's compile, the largest printed (scripts/xla_pass_times.py), as it runs,
# with XLA's Triton GEMMs off (the model's dense GEMMs on cuBLAS: no Triton GEMM fusions to
# compile and autotune), and with its kernels as Mosaic GPU makes them (a dump variable set:
# numbered modules, none compiled ahead, jax_ep/experts/compile_ahead.py), with the expert
# products on lax.ragged_dot (no Mosaic GPU kernel to lower and build), and the steps' time
# after it, 20 steps each; the example's own output (its first step split into trace,
# lowering, compile and run) kept beside the log.
if has examplecompile; then
  for variant in ${EXAMPLECOMPILE_VARIANTS:-as_set no_triton_gemm mosaic_modules xla_experts}; do
    flag="" dump="" impl=auto
    case $variant in
      no_triton_gemm) flag="--xla_gpu_enable_triton_gemm=false" ;;
      mosaic_modules) dump=1 ;;
      xla_experts) impl=xla ;;
    esac
    log="$OUT/example_compile_$variant"
    step "examples/moe_transformer.py --mesh 1x1 --steps 20 ($variant)"
    # The dump variable only where asked: Mosaic GPU takes it as set even when empty.
    t=$(bench_time 120) && XLA_FLAGS="${XLA_FLAGS:-} $flag" env ${dump:+MOSAIC_GPU_DUMP_PTXAS=1} \
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=2,gpu_compiler=1,nvptx_compiler=1 \
      timeout $t python3 examples/moe_transformer.py --mesh 1x1 --steps 20 --experts-impl $impl \
      2> "$log.log" \
      | tee "$log.out" | grep -E "^(step|loss|PASSED|FAILED)"
    counts "examples/moe_transformer.py ($variant)"
    python3 scripts/xla_pass_times.py "$log.log" --module jit_train_step --top 6 \
      && gzip -f "$log.log"
  done
fi

# The experts in FP8 against bf16, same run: the FP8 grouped GEMM at the five model shapes
# (bench_fp8_gemm.py: against the bf16 grouped_matmul and dense GEMMs), the layer at one rank
# (bench_layer.py --precisions: the moe_mlp target is fp8 >= 1.35x bf16 forward + backward at
# one rank of DeepSeek-V3 at EP=8), and the end-to-end example trained both ways from one seed
# (its loss within 2 % of bf16's).
if has fp8; then
  step "the FP8 grouped GEMM at the five model shapes (bench_fp8_gemm.py)"
  t=$(bench_time 500) && XLA_PYTHON_CLIENT_MEM_FRACTION=.92 timeout $t python3 \
    benchmarks/bench_fp8_gemm.py ${FP8_GEMM_ARGS:-} --out gpu_round_fp8_gemm.jsonl \
    2>&1 | tee "$OUT/bench_fp8_gemm.log" | tail -40
  counts bench_fp8_gemm.py "$OUT/bench_fp8_gemm.log"
  cp benchmarks/results/gpu_round_fp8_gemm.jsonl "$OUT/" 2>/dev/null
fi
# The FP8 MLP's own kernels (the gated projections, the input gradient over [dgate | dup])
# against bf16 GEMMs of the same FLOPs: what the FP8 layer runs beside the grouped GEMM
# (FP8_KERNEL_SHAPES: default one rank of DeepSeek-V3 at EP=8, the target's shape).
if has fp8 || has fp8kernels; then
  step "the FP8 MLP's kernels (bench_fp8_gemm.py --products gate_up input_grad)"
  t=$(bench_time 300) && XLA_PYTHON_CLIENT_MEM_FRACTION=.92 timeout $t python3 \
    benchmarks/bench_fp8_gemm.py --shapes ${FP8_KERNEL_SHAPES:-deepseek_v3_ep8_rank} \
    --products gate_up input_grad --out gpu_round_fp8_gemm.jsonl \
    2>&1 | tee "$OUT/bench_fp8_kernels.log" | tail -12
  counts "bench_fp8_gemm.py --products" "$OUT/bench_fp8_kernels.log"
  cp benchmarks/results/gpu_round_fp8_gemm.jsonl "$OUT/" 2>/dev/null
fi
# fp8layer: the layer alone at DeepSeek-V3's EP=8 rank, each pass's 25 longest kernels printed
# (bench_layer.py --breakdown): where the FP8 layer's time goes against bf16's.
if has fp8 || has fp8layer; then
  step "the layer in FP8 and bf16, one rank (bench_layer.py --ops moe_layer --precisions bf16 fp8)"
  if has fp8; then layer_args="--shapes deepseek_v3_ep8_rank mixtral"
  else layer_args="--shapes deepseek_v3_ep8_rank --breakdown 25 --repeats 5 \
    --fp8-weight-grads fp8 bf16"; fi
  t=$(bench_time 500) && XLA_PYTHON_CLIENT_MEM_FRACTION=.92 timeout $t python3 \
    benchmarks/bench_layer.py --ops moe_layer --impls mosaic $layer_args \
    --precisions bf16 fp8 --out gpu_round_fp8_layer.jsonl \
    2>&1 | tee "$OUT/bench_fp8_layer.log" | grep -v "^WARNING" | tail -130
  counts "bench_layer.py --precisions" "$OUT/bench_fp8_layer.log"
  cp benchmarks/results/gpu_round_fp8_layer.jsonl "$OUT/" 2>/dev/null
fi
# The end-to-end example trained in bf16 and in FP8 from one seed (also the `fp8` stage's end).
if has fp8 || has fp8example; then
  for flag in "" --fp8; do
    step "examples/moe_transformer.py $flag"
    t=$(bench_time 300) && timeout $t python3 examples/moe_transformer.py --mesh 1x1 $flag 2>&1 \
      | tee "$OUT/example${flag:+_fp8}.log" | grep -E "^(step|loss|config|decode|checkpoint|PASSED)"
    counts "examples/moe_transformer.py $flag"
  done
fi

# Communication beside the experts (Group(comm_stream=1), and jax_ep's own stream with its
# pipeline, comm_stream="jax_ep"): at one rank, the hidden fraction of the ops behind the expert
# MLP (bench_overlap.py; on jax_ep's own stream at the default SM budget and the whole H200's);
# then the SwiGLU layer chain, forward + backward, with 1 and 2 micro-batches, on the compute
# stream, on stream 1 and on jax_ep's own, at one rank (T=4096) and 8 ranks emulated (T=512:
# eight processes' SwiGLU layers with the default capacity keep ~5 GB each per layer for the
# backward at T=2048, more than the GPU holds) (OVERLAP_ARGS passed to bench_layers.py).
if has overlap; then
  step "communication beside the experts, one rank (bench_overlap.py)"
  t=$(bench_time 300) && XLA_PYTHON_CLIENT_MEM_FRACTION=.9 timeout $t python3 \
    benchmarks/bench_overlap.py --num-sms 24 132 --timeline "$OUT/overlap_timeline.json" \
    --out gpu_round_overlap.jsonl 2>&1 | tee "$OUT/bench_overlap.log" | grep -v "^Stream" \
    | tail -8
  counts bench_overlap.py "$OUT/bench_overlap.log"
  cp benchmarks/results/gpu_round_overlap.jsonl "$OUT/" 2>/dev/null
  overlap_args="--backends cuda --expert swiglu --passes forward_backward --micro-batches 1 2"
  overlap_args="$overlap_args --comm-streams 1 jax_ep --layers 2 --out gpu_round_layers.jsonl"
  step "SwiGLU layer chain, 1 and 2 micro-batches, compute, XLA's and jax_ep's streams, one rank"
  t=$(bench_time 300) && XLA_PYTHON_CLIENT_MEM_FRACTION=.9 timeout $t python3 \
    benchmarks/bench_layers.py $overlap_args ${OVERLAP_ARGS:-} 2>&1 \
    | tee "$OUT/bench_overlap_layers_1.log" | tail -12
  counts "bench_layers.py --comm-streams (one rank)" "$OUT/bench_overlap_layers_1.log"
  step "SwiGLU layer chain, 1 and 2 micro-batches, compute, XLA's and jax_ep's streams, 8 ranks"
  t=$(bench_time 420) && timeout $t python3 -m jax_ep.launch -n 8 --share-gpu --grace 20 \
    --timeout $((t - 20)) -- \
    python3 benchmarks/bench_layers.py $overlap_args --tokens 512 ${OVERLAP_ARGS:-} 2>&1 \
    | tee "$OUT/bench_overlap_layers_8.log" | grep -E "^\[0\] " | tail -12
  counts "bench_layers.py --comm-streams (8 ranks)" "$OUT/bench_overlap_layers_8.log"
  cp benchmarks/results/gpu_round_layers.jsonl "$OUT/" 2>/dev/null
fi

# The expert kernels and the one-rank ops of the overlap pipeline, each replayed alone by ncu
# (kernels run one at a time): their time, SM throughput, DRAM throughput and clock. Beside an op
# on the own stream's partition a GEMM runs longer by about the op's time although it keeps its
# SMs (docs/dev/notes.md): a GEMM near the DRAM ceiling beside ops that copy at ~1.2 TB/s points to
# bandwidth, a clock that drops to power. In launch order: the halves' GEMM-only and layer
# programs, then the pipeline's.
# ncu_metrics REPORT KERNELS COUNT METRICS SHOWN -- COMMAND...: ncu's METRICS of the first COUNT
# kernels matching KERNELS (a regex) that COMMAND launches, the report in $OUT/REPORT, its lines
# matching SHOWN printed.
ncu_metrics() {
  local report=$1 kernels=$2 count=$3 metrics=$4 shown=$5
  shift 6
  t=$(bench_time 400) && timeout $t ncu --clock-control none -k regex:"$kernels" -c "$count" \
    --metrics "$metrics" "$@" > "$OUT/$report" 2>&1
  counts "ncu $*"
  grep -E "$shown" "$OUT/$report" | cut -c1-120 | head -200
}
if has overlapncu; then
  step "ncu: the expert kernels and the one-rank ops in the halves and the own-stream pipeline"
  ncu_metrics ncu_overlap.txt "jax_ep_mlp_(gate_up|hidden_grad)|DispatchKernel|CombineKernel" 40 \
    gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum.per_second,\
sm__cycles_elapsed.avg.per_second \
    "jax_ep_mlp_|Kernel<|gpu__time_duration|throughput|dram__bytes|cycles_elapsed" -- \
    python3 benchmarks/bench_overlap.py --host-clock --passes forward_backward --comm-streams \
    jax_ep --repeats 1 --out /tmp/overlap_ncu.jsonl
fi

# The FP8 layer's bandwidth-bound kernels: how far from the DRAM roofline each runs and why
# (a kernel with few resident warps waits on memory latency).
if has fp8ncu; then
  step "ncu: the FP8 layer's column copies, activation gradient and weight gradients"
  ncu_metrics ncu_fp8.txt "jax_ep_(fp8_quantize_columns|fp8_activation_grad|fp8_wgrad)" 14 \
    gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__bytes.sum.per_second,sm__warps_active.avg.pct_of_peak_sustained_active,\
launch__registers_per_thread,launch__shared_mem_per_block,launch__occupancy_limit_registers,\
launch__occupancy_limit_shared_mem,launch__occupancy_limit_warps,launch__grid_size \
    "jax_ep_|gpu__time|dram__|warps_active|launch__" -- \
    python3 benchmarks/bench_layer.py --ops moe_layer --shapes deepseek_v3_ep8_rank \
    --precisions fp8 --repeats 1 --out /tmp/fp8_ncu.jsonl
fi

# What bounds the grouped GEMM at each model shape: the matrix units (tensor pipe), the L2
# (each row tile reads its expert's weight panel through it) or DRAM (each expert's weights
# once, at least). In launch order: per shape the forward, then forward + backward. One call
# of each (--repeats 0: no profiler of its own beside ncu's), no padded buffer, and memory
# allocated as used: ncu saves and restores the device memory a kernel may touch around each
# of its replays, which with XLA's preallocated pool took minutes a kernel.
if has gemmncu; then
  step "ncu: the grouped GEMM's kernels at the five model shapes (bench_layer.py)"
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
  ncu_metrics ncu_gemm.txt "jax_ep_gmm" 24 \
    gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,\
lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum,\
sm__cycles_elapsed.avg.per_second \
    "jax_ep_gmm|gpu__time|throughput|pipe_tensor|lts__|dram__bytes|cycles_elapsed" -- \
    python3 benchmarks/bench_layer.py --ops grouped_matmul --impls mosaic --alignments 1 \
    --repeats 0 --pad 0 ${GEMMNCU_ARGS:-} --out /tmp/gemm_ncu.jsonl
fi

chain_args="--backends cuda --expert identity swiglu --passes forward forward_backward"
chain_args="$chain_args --capacities default tight"
if has layers; then
  step "layer chain, one rank"
  XLA_PYTHON_CLIENT_MEM_FRACTION=.9 timeout 200 python3 benchmarks/bench_layers.py $chain_args \
    --layers 2 --out gpu_round_layers.jsonl ${LAYER_ARGS:-} 2>&1 \
    | tee "$OUT/bench_layers_1.log" | tail -16
  for n in ${LAYER_RANKS:-2 8}; do
    step "layer chain, $n ranks emulated"
    timeout 240 python3 -m jax_ep.launch -n $n --share-gpu --grace 20 --timeout 220 -- \
      python3 benchmarks/bench_layers.py $chain_args --out gpu_round_layers.jsonl \
      ${LAYER_ARGS:-} 2>&1 | tee "$OUT/bench_layers_$n.log" | grep -E "^\[0\] " | tail -16
  done
  cp benchmarks/results/gpu_round_layers.jsonl "$OUT/" 2>/dev/null
fi

if has layer; then
  for n in 1 ${LAYER_TEST_RANKS:-2 4}; do
    step "the MoE layer on the cuda backend, model shapes included, against the dense model, $n rank(s)"
    layer_suite $n
  done
fi

if has gemm; then
  step "grouped matmul on the GPU: tests"
  gemm_suite
  step "grouped matmul and MoE layer at model shapes (bench_layer.py)"
  t=$(bench_time 400) && timeout $t python3 benchmarks/bench_layer.py ${GEMM_ARGS:-} \
    --out gpu_round_layer.jsonl --plot "$OUT/layer.png" 2>&1 | tee "$OUT/bench_layer.log" | tail -40
  counts bench_layer.py "$OUT/bench_layer.log"
  cp benchmarks/results/gpu_round_layer.jsonl "$OUT/" 2>/dev/null
fi

if has gemmtune; then
  step "the grouped GEMM's tile sets at ${GEMMTUNE_SHAPES:-deepseek_v3} (bench_layer.py --tune)"
  t=$(bench_time 560) && XLA_PYTHON_CLIENT_MEM_FRACTION=.92 timeout $t python3 \
    benchmarks/bench_layer.py --ops grouped_matmul --impls mosaic --alignments 1 --pad 0 \
    --shapes ${GEMMTUNE_SHAPES:-deepseek_v3} --tune ${GEMMTUNE_PARTS:-forward weight_grad} \
    --repeats 5 \
    --out gpu_round_gemm_tune.jsonl 2>&1 | tee "$OUT/bench_gemm_tune.log" \
    | grep -E "TF/s|KernelTiles|failed" | tail -120
  # Its exit status alone: a tile set that does not fit (shared memory, registers) is a
  # reported ": failed: " variant the tune skips.
  counts bench_layer.py
  cp benchmarks/results/gpu_round_gemm_tune.jsonl "$OUT/" 2>/dev/null
fi

if has experts || has expertsbench || has expertsgemm; then
  if has experts; then
    step "the fused expert MLP on the GPU: tests at the five model shapes"
    experts_suite
  fi
  if has experts || has expertsbench; then
    step "expert_mlp at the five model shapes: fused and unfused, exact and padded buffers (bench_expert_mlp.py)"
    t=$(bench_time 500) && XLA_PYTHON_CLIENT_MEM_FRACTION=.92 timeout $t python3 \
      benchmarks/bench_expert_mlp.py ${EXPERT_ARGS:-} --out gpu_round_expert_mlp.jsonl \
      2>&1 | tee "$OUT/bench_expert_mlp.log" | tail -50
    counts bench_expert_mlp.py "$OUT/bench_expert_mlp.log"
    cp benchmarks/results/gpu_round_expert_mlp.jsonl "$OUT/" 2>/dev/null
  fi
  step "grouped_matmul at the five model shapes (bench_layer.py --ops grouped_matmul)"
  t=$(bench_time 400) && XLA_PYTHON_CLIENT_MEM_FRACTION=.92 timeout $t python3 \
    benchmarks/bench_layer.py --ops grouped_matmul --impls mosaic --alignments 1 \
    --out gpu_round_expert_gemm.jsonl 2>&1 | tee "$OUT/bench_expert_gemm.log" | tail -30
  counts bench_layer.py "$OUT/bench_expert_gemm.log"
  cp benchmarks/results/gpu_round_expert_gemm.jsonl "$OUT/" 2>/dev/null
fi

if has lowlatency || has ll1; then
  step "low-latency suite, one rank"
  suite --timeout 200 -- $PYTEST tests/test_cuda_local.py -k LowLatency
fi
for n in ${LL_RANKS:-2 4 8}; do
  if has lowlatency || has ll$n; then
    step "low-latency suite, $n ranks emulated"
    suite --ranks $n --timeout ${LL_SUITE_TIMEOUT:-240} -- $PYTEST tests/test_cuda_peer.py \
      -k LowLatency -o faulthandler_timeout=120
  fi
done
if has lowlatency || has llown; then
  step "low-latency command buffers and fault case (processes of their own)"
  suite --timeout 240 -- $PYTEST tests/test_cuda_peer.py -k "command_buffers or skip_low_latency"
fi
if has lowlatency || has llsanitize; then
  step "compute-sanitizer memcheck and racecheck on the low-latency pair, 2 ranks emulated"
  low_latency_sanitize
fi
if has lowlatency || has llbench; then
  step "low-latency benchmark, one rank"
  timeout 200 python3 benchmarks/bench_low_latency.py --out gpu_round_low_latency.jsonl \
    ${LL_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_ll_1.log" | tail -40
  for n in ${LL_BENCH_RANKS:-8}; do
    step "low-latency benchmark, $n ranks emulated"
    timeout 300 python3 -m jax_ep.launch -n $n --share-gpu --grace 20 --timeout 290 -- \
      python3 benchmarks/bench_low_latency.py --out gpu_round_low_latency.jsonl \
      ${LL_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_ll_$n.log" | grep -E "^\[0\] " | tail -40
  done
  cp benchmarks/results/gpu_round_low_latency.jsonl "$OUT/" 2>/dev/null
fi

if has slab; then
  step "experts on the low-latency slabs: kernels that stop at each count, against the dense batched matmul"
  slab_suite
  timeout 300 python3 benchmarks/bench_slab_mlp.py --out gpu_round_slab_mlp.jsonl 2>&1 \
    | tee "$OUT/bench_slab.log" | tail -14
  cp benchmarks/results/gpu_round_slab_mlp.jsonl "$OUT/" 2>/dev/null
fi

if has llncu; then
  step "ncu: the low-latency kernels at one rank, T=128, fp8 dispatch (scripts/profile_low_latency.py)"
  timeout 240 ncu --clock-control none --set detailed --profile-from-start off \
    -k regex:"Dispatch|Combine" -c 6 --print-details all \
    python3 scripts/profile_low_latency.py --profiler-range --runs 3 > "$OUT/ncu_ll.txt" 2>&1
  grep -E "Kernel[<(]|^ +Duration|DRAM Throughput|^ +Memory Throughput|Achieved Occupancy|Grid Size|Registers Per|Waves Per SM" \
    "$OUT/ncu_ll.txt" | cut -c1-150 | head -80
fi

if has nvshmem; then
  step "NVSHMEM: join by unique id and a put-with-signal ring, 2/4/8 PEs sharing the GPU (MPS)"
  nvshmem_suite
fi

# The network transport: 8 ranks as virtual hosts (NET_HOSTS, default "2 4": 2 x 4 and 4 x 2),
# then the tests that start their own ranks (command buffers, a peer that skips the call), then
# memcheck of a small case at 2 x 1; NET_BENCH=1 adds the benchmark at 2 x 4.
if has network; then
  for k in ${NET_HOSTS:-2 4}; do
    step "network transport: 8 ranks as $k virtual hosts"
    network_suite $k
  done
  step "network transport: command buffers and a peer that skips the call"
  network_own_suite
fi
if has network || has netsanitize; then
  step "network transport: compute-sanitizer memcheck, 2 ranks on 2 virtual hosts"
  network_memcheck
fi
if has network || has netsanitize || has netrail; then
  step "network transport: compute-sanitizer memcheck of the rail exchange, 2 ranks on 2 virtual hosts"
  rail_memcheck
fi
if has network; then
  if [ "${NET_BENCH:-0}" = 1 ]; then
    step "low-latency benchmark, 8 ranks as 2 virtual hosts"
    timeout 300 python3 -m jax_ep.launch -n 8 --share-gpu --grace 20 --timeout 290 -- \
      python3 benchmarks/bench_low_latency.py --virtual-hosts 2 --out gpu_round_low_latency.jsonl \
      ${LL_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_ll_net.log" | grep -E "^\[0\] " | tail -40
    cp benchmarks/results/gpu_round_low_latency.jsonl "$OUT/" 2>/dev/null
  fi
fi

# The high-throughput ops across virtual hosts, 8 ranks: the layer chain of the group a user
# gets on one host beside the same ranks as 2 virtual hosts (one run), then the per-op numbers
# of both (NETBENCH_ARGS passed to bench_intranode.py; by default no marginal batches and no
# steady-period program, whose 16 calls' rows ran out of memory with 8 ranks on one GPU).
if has netbench || has netlayers; then
  step "layer chain, 8 ranks emulated: one host and 2 virtual hosts"
  timeout 330 python3 -m jax_ep.launch -n 8 --share-gpu --grace 20 --timeout 320 -- \
    python3 benchmarks/bench_layers.py --backends cuda --virtual-hosts 1 2 \
    --out gpu_round_layers.jsonl ${LAYER_ARGS:-} 2>&1 | tee "$OUT/bench_layers_net.log" \
    | grep -E "^\[0\] " | drop_noise | tail -12
  cp benchmarks/results/gpu_round_layers.jsonl "$OUT/" 2>/dev/null
fi
if has netbench || has netops; then
  for v in 1 2; do
    step "high-throughput ops, 8 ranks emulated as $v virtual host(s)"
    timeout 240 python3 -m jax_ep.launch -n 8 --share-gpu --grace 20 --timeout 230 -- \
      python3 benchmarks/bench_intranode.py --backends cuda --virtual-hosts $v \
      --out gpu_round_intranode.jsonl ${NETBENCH_ARGS:---no-marginal --steady-calls 0} 2>&1 \
      | tee "$OUT/bench_intranode_net_$v.log" \
      | grep -E "^\[0\] (  |op |dispatch|combine|cuda|wrote)" | tail -40
  done
  cp benchmarks/results/gpu_round_intranode.jsonl "$OUT/" 2>/dev/null
fi

# Several GPUs. Per R in MULTI_RANKS: the suites (multi_suites) and the benchmark
# (multi_bench), one process per GPU and one process driving them all. One call per stage and R
# keeps each under the 600 s limit: MULTI_RANKS=8 bash scripts/gpu_round.sh multi_suites
# (multi_bench runs the per-GPU, one-process and isolated benchmarks and the MULTI_SMS variants,
# on two H200s ~25-35 s each with the marginal batches; MULTI_SMS="" drops the SM-budget
# variants, MULTI_SEND_RECV=1 adds XLA's send/recv fallback, which hung there until the timeout).
num_gpus=$(nvidia-smi -L | grep -c "^GPU ")
multi_suites="tests/test_cuda_peer.py tests/test_xla_pipeline.py tests/test_reference.py"
# (The layer at model shapes is the `layer` stage's: left out here.)
multi_suites="$multi_suites tests/test_api.py tests/test_layer.py tests/test_micro_batches.py"
multi_suites="$multi_suites --deselect tests/test_layer.py::TestModelShapes"
for n in ${MULTI_RANKS:-2 4 8}; do
  if ! { has multi || has multi_suites || has multi_bench; }; then break; fi
  [ "$n" -le "$num_gpus" ] || { echo "skip R=$n: $num_gpus GPUs"; continue; }
  gpus=$(seq -s, 0 $((n - 1)))
  # MULTI_PASSES picks the process models (default all three, ~80 s each on two H200s; at
  # R=8 they may not all fit one call's 600 s, so run them in separate calls there).
  passes=" ${MULTI_PASSES:-per_gpu isolated one_process} "
  if { has multi || has multi_suites; } && [[ "$passes" == *" per_gpu "* ]]; then
    step "suites, $n processes with one GPU each (GPUs $gpus)"
    CUDA_VISIBLE_DEVICES=$gpus timeout 280 python3 -m jax_ep.launch -n $n --grace 20 \
      --timeout 260 -- python3 -m pytest $multi_suites -q -rf -p no:cacheprovider 2>&1 \
      | tee -a "$OUT/multi_suites.log" | drop_noise | grep -E " passed| failed|rror|Traceback" \
      | tail -$((n + 6))
  fi
  if { has multi || has multi_suites; } && [[ "$passes" == *" isolated "* ]]; then
    step "suites, $n processes each seeing only its own GPU (--isolate-gpus)"
    CUDA_VISIBLE_DEVICES=$gpus timeout 280 python3 -m jax_ep.launch -n $n --isolate-gpus \
      --grace 20 --timeout 260 -- python3 -m pytest $multi_suites -q -rf -p no:cacheprovider \
      2>&1 | tee -a "$OUT/multi_suites.log" | drop_noise \
      | grep -E " passed| failed|rror|Traceback" | tail -$((n + 6))
  fi
  if { has multi || has multi_suites; } && [[ "$passes" == *" one_process "* ]]; then
    step "suites, one process driving $n GPUs"
    CUDA_VISIBLE_DEVICES=$gpus timeout 280 python3 -m pytest \
      $multi_suites -q -rf -p no:cacheprovider 2>&1 | tee -a "$OUT/multi_suites.log" | tail -6
  fi
  if has multi || has multi_bench; then
    # The standard run (every backend, per-kernel breakdown, host_clock_marginal records), the
    # one-process run (where XLA's own ragged all-to-all kernel works), the cuda backend with
    # each process seeing only its own GPU, then variants without the breakdown: the cuda
    # group's SM budget (MULTI_SMS), and last, only with MULTI_SEND_RECV=1, XLA's NCCL send/recv
    # fallback for the plain-XLA pipeline (one process per GPU leaves XLA no other ragged
    # all-to-all; on two H200s it hung until the launcher's timeout, 260 s of device time).
    for variant in "" one_process isolated ${MULTI_SMS-48 96} $( [ "${MULTI_SEND_RECV:-0}" = 1 ] && echo send_recv ); do
      launch_flags=""
      case $variant in
        "") args=""; what="every backend" ;;
        one_process) args="" ;;
        isolated) args="--backends cuda"; launch_flags="--isolate-gpus"
                  what="cuda, each process seeing only its own GPU" ;;
        send_recv) args="--backends xla_baseline --xla-ragged send_recv --no-breakdown"
                   what="plain XLA, NCCL send/recv fallback" ;;
        *) args="--backends cuda --num-sms $variant --no-breakdown"; what="cuda, $variant SMs" ;;
      esac
      if [ "$variant" = one_process ]; then
        step "benchmark, one process driving $n GPUs"
        CUDA_VISIBLE_DEVICES=$gpus timeout 280 \
          python3 benchmarks/bench_intranode.py --out gpu_round_intranode.jsonl 2>&1 \
          | tee -a "$OUT/multi_bench.log" | grep -E "^(  |op |dispatch|combine|cuda|reference|xla|wrote)|rror|Traceback"
      else
        step "benchmark, $n processes with one GPU each: $what"
        CUDA_VISIBLE_DEVICES=$gpus timeout 280 python3 -m jax_ep.launch -n $n $launch_flags \
          --grace 20 --timeout 260 -- python3 benchmarks/bench_intranode.py --out gpu_round_intranode.jsonl $args 2>&1 \
          | tee -a "$OUT/multi_bench.log" | drop_noise \
          | grep -E "^\[0\] (  |op |dispatch|combine|cuda|reference|xla|wrote)|rror|Traceback"
      fi
      cp benchmarks/results/gpu_round_intranode.jsonl "$OUT/" 2>/dev/null  # kept if a later run is cut
    done
  fi
done

if [ -s "$OUT/gpu_suites.jsonl" ]; then
  step "suites of this round (records in $OUT/gpu_suites.jsonl)"
  python3 - "$OUT/gpu_suites.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  ok = r["failed"] == 0 and r["errors"] == 0
  hosts = f" x{r['virtual_hosts']} hosts" if r["virtual_hosts"] else ""
  print(f"{'PASS' if ok else 'FAIL'}  R={r['ranks']}{hosts:10s} {r['passed']:4d} passed "
        f"{r['failed']:3d} failed {r['skipped']:3d} skipped {r['errors']:2d} errors "
        f"{r['wall_s']:6.0f} s  {r['suite']}")
PY
fi
# The logs and reports as one file (a call brings a few files back, not one per suite), with
# those of earlier rounds of the same call.
if [ -d "$OUT/logs" ] || [ -d "$OUT/junit" ]; then
  [ -f "$OUT/round_logs.tgz" ] && tar -xzf "$OUT/round_logs.tgz" -C "$OUT"
  tar -czf "$OUT/round_logs.tgz" -C "$OUT" $(cd "$OUT" && ls -d logs junit 2>/dev/null) \
    && rm -rf "$OUT/logs" "$OUT/junit"
fi
exit $status
