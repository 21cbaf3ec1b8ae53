"""High-throughput dispatch and combine across R ranks on the cuda intranode transport.

  # R ranks emulated on one GPU (CUDA MPS), one process each:
  python -m jax_ep.launch -n 8 --share-gpu -- python benchmarks/bench_intranode.py
  # ... as 2 virtual hosts of 4, their traffic between hosts on the network transport:
  python -m jax_ep.launch -n 8 --share-gpu -- python benchmarks/bench_intranode.py --virtual-hosts 2
  # one process per GPU, or one process for all GPUs of a host:
  python -m jax_ep.launch -n 8 -- python benchmarks/bench_intranode.py
  python benchmarks/bench_intranode.py

  # the FP8 dispatch beside the bf16 one, same inputs, same run (records' `wire_dtype`):
  python -m jax_ep.launch -n 8 --share-gpu -- python benchmarks/bench_intranode.py \
      --wire-format plain fp8

Standard shape: 4096 tokens per rank, H=7168, top-8 of 256 experts, bf16. Every rank runs the
same calls in lockstep and times them with the host clock around batches of `--calls` calls on
rotating inputs; the slowest rank's median is reported (the op is done when every rank is).
A batch's first call also waits for the last process to reach it: the processes' start skew
(measured at ~0.6 ms between two processes of one host), which a batch of 4 spreads as ~150 us
over each call. `timing="host_clock_marginal"` takes it out: a batch of 2 x `--calls` calls less
a batch of `--calls`, per added call (the back-to-back cost of a call inside a long program).
Both host-clock records also count the harness's host work on each call's inputs before the
program reaches the device (100-150 µs per call of three sharded arrays on two H200s), which a
model's layers, whose inputs live inside the program, do not pay. `timing="device_clock_steady"`
(cuda backend, on a GPU) leaves both out: in one program of `--steady-calls` calls, the device
clock's period from one call's last kernel to the next's, after the first call (which waits out
the skew); waiting for a slower peer stays in.
Records (DESIGN.md section 6) are written by process 0 to benchmarks/results/. The reference
backend and the plain-XLA `ragged_all_to_all` pipeline need XLA collectives, so they run only
when the processes do not share a GPU.

Accounting: `bytes` = rows this rank receives, one per (source token, this rank) pair (dispatch;
the same rows travel back in combine). `min_hbm_bytes` (shared GPU: summed over ranks) = every
source row read once + every selected slot's row written once (dispatch), the reverse for combine.
`roofline`: on one GPU, least bytes over the copy bound; on several GPUs, the rows a rank
receives from other ranks (`nvlink_bytes`; its own tokens never cross NVLink) per second, over the
NVLink line rate measured in the same run (a 1 GiB one-direction GPU 0 -> GPU 1 copy, `bound` =
"p2p_copy"). The plain-XLA baseline (`xla_baseline`, benchmarks/xla_pipeline.py:
sort, counts, ragged all-to-all, local permute, and back) runs wherever XLA collectives do.
`--wire-format`: each `jax_ep.RowFormat` given is timed in turn on the same inputs (a group per
format and backend); an fp8 format's records carry `wire_dtype` float8_e4m3fn and count a row as
its e4m3 bytes with their scales (`bytes`, `min_hbm_bytes`: the source rows still read in bf16);
its combine, the same op as the plain group's, is not timed again. `--fp8-quantized-by
dispatch caller` times each fp8 format twice: quantised inside the dispatch's send kernels (what
`jax_ep.dispatch` does with rows in the group's dtype), and by the caller in the same program
(`jax_ep.quantize`, then `dispatch(..., x_scales=...)`: the send kernels copy e4m3 rows); the
records' `fp8_quantized_by` says which.
`hosts`, `gpus_per_host`: the group's hosts (`--virtual-hosts`: the cuda group's ranks split
into that many, the other backends left out); `network_bytes` and `peer_bytes` split the rows
this rank receives by the path they took to it (benchmarks/reports.py, high_throughput_paths):
a row from another host reaches its rail receiver there by the network path, and every rank but
the one holding it by the peer path.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# How XLA runs `ragged_all_to_all` (JAX 0.11.2, XLA's RaggedAllToAllThunk): with every device in
# one process it takes its one-shot peer-pointer kernel by default; with one process per GPU that
# kernel is out of reach and XLA refuses its NCCL send/recv fallback unless a flag allows it.
# XLA_FLAGS is read when the GPU backend starts, so this is settled before jax is imported.
XLA_RAGGED_MODES = {
    "default": "",
    # One-shot kernel synchronised by an NCCL barrier, meant to work across processes. On
    # 2 x H200 with NCCL 2.28.9 XLA still refused (the fallback error) with one process per GPU;
    # it stays the default there because it fails at once and keeps the other records, where
    # the send/recv fallback may hang (as reported elsewhere).
    "nccl_barrier": "--xla_gpu_experimental_ragged_all_to_all_use_barrier_with_nccl=true",
    # NCCL send/recv per update, after a host sync on the sizes.
    "send_recv": "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true",
}
_early = argparse.ArgumentParser(add_help=False)
_early.add_argument("--xla-ragged", choices=["auto", *XLA_RAGGED_MODES], default="auto")
XLA_RAGGED = _early.parse_known_args()[0].xla_ragged
if XLA_RAGGED == "auto":  # one process per GPU (jax_ep.launch without --share-gpu) or not
  per_gpu = (int(os.environ.get("JAX_EP_NUM_PROCESSES", "1")) > 1
             and os.environ.get("JAX_EP_SHARED_GPU") != "1")
  XLA_RAGGED = "nccl_barrier" if per_gpu else "default"
if XLA_RAGGED_MODES[XLA_RAGGED]:
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_RAGGED_MODES[XLA_RAGGED]}"

from jax_ep import launch  # noqa: E402

launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import bounds  # noqa: E402
import reports  # noqa: E402
import timers  # noqa: E402
import jax_ep  # noqa: E402
import xla_pipeline  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--hidden", type=int, default=7168)
  parser.add_argument("--topk", type=int, default=8)
  parser.add_argument("--experts", type=int, default=256)
  parser.add_argument("--calls", type=int, default=4)
  parser.add_argument("--routing", choices=["uniform", "remote"], default="uniform",
                      help="uniform: K distinct experts of all E per token (the standard shape); "
                           "remote: K distinct experts of the other ranks only, so that every "
                           "row crosses to a peer (the wire-bound case that large R approaches)")
  parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                      help="skip the per-kernel device time breakdown (a profiler trace)")
  parser.add_argument("--capacity-factor", type=float, default=1.0,
                      help="receive capacity over the most slots any rank receives")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--steady-calls", type=int, default=16,
                      help="calls in the one program whose device-clock period gives the cuda "
                           "backend's device_clock_steady records (0: none)")
  parser.add_argument("--no-marginal", dest="marginal", action="store_false",
                      help="skip the host_clock_marginal records (each backend's batches timed "
                      "again at twice the calls)")
  parser.add_argument("--aligned-single", action="store_true",
                      help="cuda and reference: also time one call per run, the processes "
                      "released together by a barrier before each run (one isolated op's "
                      "latency; the batches time back-to-back calls, which a one-slot transport "
                      "runs in lockstep)")
  parser.add_argument("--out", default="intranode.jsonl")
  parser.add_argument("--backends", nargs="+", default=["cuda", "reference", "xla_baseline"],
                      choices=["cuda", "reference", "xla_baseline"])
  parser.add_argument("--xla-ragged", choices=["auto", *XLA_RAGGED_MODES], default="auto",
                      help="how XLA runs ragged_all_to_all for xla_baseline (see the top); "
                      "auto: nccl_barrier with one process per GPU, else default")
  parser.add_argument("--ragged-pieces", type=int, default=16,
                      help="xla_baseline: updates per peer in each ragged_all_to_all")
  parser.add_argument("--num-sms", type=int, default=24,
                      help="the cuda group's SM budget for its communication kernels")
  parser.add_argument("--wire-format", nargs="+", default=["plain"],
                      choices=[f.value for f in jax_ep.RowFormat],
                      help="the dispatch's wire formats (jax_ep.RowFormat values), each timed "
                           "in this run on the same inputs: plain (bf16 rows), fp8, "
                           "fp8_pow2_scales, fp8_ue8m0 (e4m3 rows with their scales; the "
                           "combine, unchanged, is timed with plain only)")
  parser.add_argument("--fp8-quantized-by", nargs="+", default=["dispatch"],
                      choices=["dispatch", "caller"],
                      help="fp8 wire formats: who quantises the rows, each timed in this run: "
                           "the dispatch (its send kernels), or the caller (jax_ep.quantize in "
                           "the same program, the rows passed with x_scales)")
  parser.add_argument("--virtual-hosts", type=int, default=1,
                      help="split the cuda group's ranks into this many virtual hosts, their "
                           "traffic between hosts on the network transport (NVSHMEM puts); "
                           "the other backends are left out")
  args = parser.parse_args()
  if args.steady_calls < 0 or args.steady_calls == 1:
    parser.error(f"--steady-calls must be 0 (none) or at least 2, got {args.steady_calls}")
  if args.virtual_hosts < 1:
    parser.error(f"--virtual-hosts must be >= 1, got {args.virtual_hosts}")
  if args.virtual_hosts > 1:
    args.backends = [b for b in args.backends if b == "cuda"]
  wire_formats = [jax_ep.RowFormat(f) for f in dict.fromkeys(args.wire_format)]

  devices = jax.devices()
  num_ranks = len(devices)
  process_model = reports.process_model(num_ranks)
  shared_gpu = process_model == "shared_gpu"
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=devices)
  sharding = NamedSharding(mesh, P("ep"))
  t, h, k, e, calls = args.tokens, args.hidden, args.topk, args.experts, args.calls
  dtype = jnp.bfloat16

  def global_array(make_shard):
    """A `[R, ...]` array; each process builds (on the host) only the shards it holds."""
    shape = np.shape(make_shard(0, probe=True))
    def shard(index):
      r = index[0].start or 0
      return make_shard(r)[None]
    return jax.make_array_from_callback((num_ranks, *shape), sharding, shard)

  local_experts = e // num_ranks
  if args.routing == "remote" and (num_ranks < 2 or k > e - local_experts):
    raise SystemExit(f"--routing remote needs at least 2 ranks and --topk <= {e - local_experts} "
                     f"(the other ranks' experts), got {num_ranks} ranks and --topk {k}")

  def route(rng, r):
    """`[T, K]` experts of the tokens of rank r under --routing."""
    if args.routing == "uniform":
      return reports.uniform_topk(rng, t, e, k)
    # K of the E - L experts outside rank r's [r * L, (r + 1) * L), uniformly.
    other = reports.uniform_topk(rng, t, e - local_experts, k)
    return np.where(other >= r * local_experts, other + local_experts, other).astype(np.int32)

  xs, idxs, ws, idx_host = [], [], [], []
  for s in range(calls):
    # Seeded per (input set, rank, what): every process derives the same routing for every rank.
    rng_of = lambda r, what, s=s: np.random.default_rng([s, r, what])
    xs.append(global_array(lambda r, probe=False, rng_of=rng_of: np.zeros((t, h), dtype) if probe
                           else rng_of(r, 0).standard_normal((t, h), np.float32).astype(dtype)))
    idx = np.stack([route(rng_of(r, 1), r) for r in range(num_ranks)])
    idxs.append(global_array(lambda r, probe=False, idx=idx: idx[r]))
    idx_host.append(idx)
    ws.append(global_array(lambda r, probe=False, rng_of=rng_of:
                           rng_of(r, 2).random((t, k)).astype(np.float32)))

  # Field accounting from the routing of the first input set (uniform routing: all sets alike).
  dest = idx_host[0] // (e // num_ranks)
  recv_tokens = [int(np.sum(np.any(dest == r, axis=-1))) for r in range(num_ranks)]
  # Of those, the rows that cross NVLink (not a rank's own tokens): what the line rate bounds.
  remote_tokens = [recv_tokens[r] - int(np.sum(np.any(dest[r] == r, axis=-1)))
                   for r in range(num_ranks)]
  # Receive capacity: the most slots any rank receives over the input sets, times the capacity
  # factor (the contract's worst-case default, R * T * min(K, L) rows, is mostly zero tail here).
  most_slots = max(int(np.sum(i // (e // num_ranks) == r)) for i in idx_host
                   for r in range(num_ranks))
  capacity = int(np.ceil(most_slots * args.capacity_factor / 128) * 128)
  slot_rows = num_ranks * t * k

  def accounting(fmt):
    """The records' byte fields of a wire format: a received row is `H` bf16 values, or `H`
    e4m3 bytes with their scales (sizing.low_latency_row_bytes); the source rows are read in
    bf16 either way."""
    row = jax_ep.sizing.low_latency_row_bytes(fmt, h, dtype)
    return dict(row_bytes=row, bytes=int(np.mean(recv_tokens)) * row,
                nvlink_bytes=int(np.mean(remote_tokens)) * row,
                min_hbm_bytes=num_ranks * t * h * 2 + slot_rows * row,
                wire_dtype="float8_e4m3fn" if fmt.is_fp8 else "bfloat16",
                wire_format=fmt.value)
  plain = accounting(jax_ep.RowFormat.PLAIN)

  one_gpu = process_model in ("shared_gpu", "single_device")
  if one_gpu or devices[0].platform != "gpu":
    bound_gbps, bound_name = (bounds.copy_bound_gbps() if jax.process_index() == 0
                              else (0.0, "copy"))
  else:  # several GPUs: rows cross NVLink, so the line rate is the bound
    line = bounds.p2p_line_rate_gbps() if jax.process_index() == 0 else 0.0
    if line is not None:
      bound_gbps, bound_name = line, "p2p_copy"
    else:
      copy_gbps, copy_name = bounds.copy_bound_gbps()
      bound_gbps, bound_name = copy_gbps / 2, f"{copy_name} / 2 (no P2P probe)"
  bound_gbps = reports.gather_max("bound", bound_gbps, timeout_s=400)
  base = dict(mode="high_throughput", ranks=num_ranks, process_model=process_model,
              tokens_per_rank=t, hidden=h, topk=k, experts=e, dtype="bfloat16",
              bound_gbps=round(bound_gbps, 1), bound=bound_name, capacity=capacity,
              default_capacity=jax_ep.default_capacity(num_ranks, t, k, e // num_ranks),
              num_sms=args.num_sms, routing=args.routing, virtual_hosts=args.virtual_hosts)
  records = []

  # Fields a backend's group adds to its records (the cuda transport's receive mode).
  backend_fields = {}

  # The wire format being timed: its byte fields (`accounting`).
  wire = dict(plain)

  def variant():
    """The wire format being timed, and who quantised its rows (fp8)."""
    return f"{wire['wire_format']}:{wire.get('fp8_quantized_by', '')}"

  def add(op, backend, seconds, per_run=calls, timing="host_clock", gathered=False, **extra):
    """One record from this process's `seconds` per run (the slowest process's, when
    `gathered` already), of the wire format being timed."""
    if not gathered:
      seconds = reports.gather_max(f"{backend}/{variant()}/{op}/{timing}", seconds)
    median_us = seconds / per_run * 1e6
    roofline = ((wire["min_hbm_bytes"] / (bound_gbps * 1e9)) / (median_us * 1e-6) if one_gpu
                else wire["nvlink_bytes"] / (median_us * 1e-6) / 1e9 / bound_gbps)
    fields = {key: v for key, v in wire.items() if key != "row_bytes"}
    records.append(reports.record(op=op, backend=backend, median_us=round(median_us, 1),
                                 timing=timing, calls_per_run=per_run,
                                 gbps=round(wire["bytes"] / (median_us * 1e-6) / 1e9, 1),
                                 roofline=round(roofline, 3), **base, **fields,
                                 **backend_fields.get(backend, {}), **extra))

  # One program running a call per input set, back to back (what a model's layers do).
  batched = lambda fn: jax.jit(lambda *sets: [fn(*a) for a in zip(*sets)])

  def breakdown(title, fn, fn_args):
    """Process 0's device time per kernel for one batch of `calls` (where the time goes)."""
    if not args.breakdown or devices[0].platform != "gpu":
      return
    rows, activity = timers.trace_breakdown(fn, fn_args)
    if jax.process_index() == 0 and rows:
      print(f"{title}: device time per call by kernel (process 0; us, launches)")
      for name, us, launches in rows[:12]:
        print(f"  {us / calls:9.1f}  {launches / calls:4.1f}  {name[:90]}")
      for plane, busy_us, span_us in activity:
        print(f"  {plane}: some kernel running {busy_us / calls:.1f} us of a "
              f"{span_us / calls:.1f} us span per call")

  def add_marginal(op, backend, fn, sets, seconds, **extra):
    """The cost of one more back-to-back call, the processes' start skew taken out: the median
    of a batch of 2 x calls (the input sets twice) less `seconds`, this process's median of a
    batch of calls. Both batches' first calls wait out the same skew, so it cancels in the
    difference. The record is the slowest process's difference (each process's own, not the
    difference of the gathered batch records), per added call; its calls_per_run is `calls`,
    the calls added."""
    if not args.marginal:
      return
    double, _ = timers.time_batches(batched(fn), [list(s) * 2 for s in sets],
                                    repeats=args.repeats, method="host_clock")
    # Decided on the slowest process's value, so that every process takes the same branch.
    added = reports.gather_max(f"{backend}/{variant()}/{op}/marginal_check",
                               double - seconds)
    if added <= 0:
      if jax.process_index() == 0:
        print(f"{backend} {op}: no host_clock_marginal record (the longer batch was not slower: "
              "timing noise larger than a call; raise --repeats or --calls)")
      return
    add(op, backend, added, timing="host_clock_marginal", gathered=True, **extra)

  def add_device_steady(op, backend, fn, sets, marker="FinishKernel"):
    """The period of back-to-back calls on the device clock, inside one program of
    `--steady-calls` calls (the input sets repeated): from one call's FinishKernel to the next's
    (timers.steady_call_period_us; across hosts the rail exchange's, which runs once per call
    where the host groups' run once per source host). Host timing noise and the processes'
    start skew (the first call's wait) stay out; waiting for a slower peer stays in. The
    slowest process's median."""
    if args.steady_calls < 2 or devices[0].platform != "gpu":
      return
    repeat = -(-args.steady_calls // calls)
    steady_sets = [(list(s) * repeat)[:args.steady_calls] for s in sets]
    # Each of the program's calls keeps its output: at the standard shape eight processes'
    # programs of 16 dispatches do not fit an 80 GB GPU.
    program = batched(fn)
    if not reports.fits_gpu(program, steady_sets,
                            f"{backend}/{variant()}/{op}/steady",
                            f"{backend} {op}, {args.steady_calls} calls in one program",
                            sharing=num_ranks if shared_gpu else 1,
                            reserved_bytes=reports.comm_buffer_bytes(group),
                            hint="fewer --steady-calls or --tokens fit"):
      return
    period_us = timers.steady_call_period_us(
        program, steady_sets, calls_per_run=args.steady_calls, marker=marker)
    # Decided on every process's value, so that every process takes the same branch.
    if reports.gather_max(f"{backend}/{variant()}/{op}/steady_missing",
                          float(period_us is None)) > 0:
      if jax.process_index() == 0:
        print(f"{backend} {op}: no device_clock_steady record (no readable trace, or no "
              "FinishKernel once per call)")
      return
    add(op, backend, period_us * 1e-6, per_run=1, timing="device_clock_steady",
        steady_calls=args.steady_calls)

  def add_aligned_single(op, backend, fn, fn_args):
    """One call per run, every process released by a barrier before each run."""
    if not args.aligned_single:
      return
    seconds, _ = timers.time_batches(
        jax.jit(fn), fn_args, repeats=args.repeats, method="host_clock",
        before_each=lambda r: reports.barrier(f"{backend}/{variant()}/{op}/{r}"))
    add(op, backend, seconds, per_run=1, timing="host_clock_aligned")

  backends = [b for b in args.backends if b != "xla_baseline"
              and not (shared_gpu and b == "reference")]
  variants = [(f, b, q) for f in wire_formats for b in backends
              for q in (dict.fromkeys(args.fp8_quantized_by) if f.is_fp8 else [None])]
  for fmt, backend, quantized_by in variants:
    wire.clear()
    wire.update(accounting(fmt))
    if quantized_by is not None:
      wire["fp8_quantized_by"] = quantized_by
    hosts = {"virtual_hosts": args.virtual_hosts} if args.virtual_hosts > 1 else {}
    group = jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
                         dtype=dtype, backend=backend, capacity=capacity, num_sms=args.num_sms,
                         wire_format=fmt, **hosts)
    topo = group.topology
    marker = ("rail", "FinishKernel") if topo is not None and topo.num_hosts > 1 else "FinishKernel"
    network_rows, peer_rows = reports.high_throughput_paths(dest, topo)
    backend_fields[backend] = dict(
        hosts=topo.num_hosts if topo else 1,
        gpus_per_host=list(topo.gpus_per_host) if topo else [num_ranks],
        network_bytes=int(network_rows * wire["row_bytes"]),
        peer_bytes=int(peer_rows * wire["row_bytes"]))
    if group.backend_name == "cuda" and num_ranks > 1:
      # Every rank decides on its own; the record says whether all of them receive.
      not_receiving = reports.gather_max("not_receiving", float(not group.receives_while_sending))
      backend_fields[backend]["receives_while_sending"] = not_receiving == 0.0
    per_shard = lambda fn: jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    dispatch = per_shard(lambda x, i, w: jax.tree.map(
        lambda v: v[None], jax_ep.dispatch(group, x[0], i[0], w[0])))
    # Timed returning the received rows only (fp8: with their scales): in a model the handle
    # stays inside the program (returning it makes XLA copy outputs that alias inputs or each
    # other).
    def dispatched(x, i, w, group=group, fmt=fmt, quantized_by=quantized_by):
      if quantized_by == "caller":
        q, scales = jax_ep.quantize(x, row_format=fmt)
        return jax_ep.dispatch(group, q, i, w, x_scales=scales)
      return jax_ep.dispatch(group, x, i, w)
    dispatch_recv = per_shard(lambda x, i, w: jax.tree.map(
        lambda v: v[None], (lambda recv: (recv.x, recv.scales) if fmt.is_fp8 else recv.x)(
            dispatched(x[0], i[0], w[0])[0])))
    seconds, _ = timers.time_batches(batched(dispatch_recv), (xs, idxs, ws),
                                     repeats=args.repeats, method="host_clock")
    add("dispatch", backend, seconds)
    add_marginal("dispatch", backend, dispatch_recv, (xs, idxs, ws), seconds)
    breakdown(f"{backend} dispatch ({fmt.value}"
              f"{', quantised by the ' + quantized_by if quantized_by else ''})",
              batched(dispatch_recv), (xs, idxs, ws))
    if group.backend_name == "cuda":
      add_device_steady("dispatch", backend, dispatch_recv, (xs, idxs, ws), marker)
    add_aligned_single("dispatch", backend, dispatch_recv, (xs[0], idxs[0], ws[0]))
    if fmt.is_fp8:  # the combine takes the activations' rows as the plain group's does
      group.check()
      group.close()
      continue
    results = [jax.jit(dispatch)(x, i, w) for x, i, w in zip(xs, idxs, ws)]
    eos = [recv.x for recv, _ in results]
    handles = [handle for _, handle in results]
    combine = per_shard(lambda eo, hd: jax_ep.combine(
        group, eo[0], jax.tree.map(lambda v: v[0], hd))[None])
    seconds, _ = timers.time_batches(batched(combine), (eos, handles), repeats=args.repeats,
                                     method="host_clock")
    add("combine", backend, seconds)
    add_marginal("combine", backend, combine, (eos, handles), seconds)
    breakdown(f"{backend} combine", batched(combine), (eos, handles))
    if group.backend_name == "cuda":
      add_device_steady("combine", backend, combine, (eos, handles), marker)
    add_aligned_single("combine", backend, combine, (eos[0], handles[0]))
    group.check()
    group.close()

  def time_xla_baseline():
    # The plain-XLA pipeline (benchmarks/xla_pipeline.py), dispatch and combine timed apart.
    # The same receive capacity as the cuda backend (>= the most slots any rank receives here).
    ragged = xla_pipeline.split_updates(jax.lax.ragged_all_to_all, args.ragged_pieces)
    kw = dict(axis="ep", num_ranks=num_ranks, num_experts=e, capacity=capacity, ragged=ragged)
    how = dict(xla_ragged=XLA_RAGGED, ragged_pieces=args.ragged_pieces)
    per_shard = lambda fn: jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    xla_dispatch = per_shard(lambda x, i: jax.tree.map(
        lambda v: v[None], xla_pipeline.dispatch(x[0], i[0], **kw)))
    seconds, _ = timers.time_batches(batched(xla_dispatch), (xs, idxs), repeats=args.repeats,
                                     method="host_clock")
    add("dispatch", "xla_baseline", seconds, **how)
    add_marginal("dispatch", "xla_baseline", xla_dispatch, (xs, idxs), seconds, **how)
    breakdown("xla_baseline dispatch", batched(xla_dispatch), (xs, idxs))
    results = [jax.jit(xla_dispatch)(x, i) for x, i in zip(xs, idxs)]
    grouped = [g for g, _, _ in results]
    states = [state for _, _, state in results]
    xla_combine = per_shard(lambda eo, w, st: xla_pipeline.combine(
        eo[0], w[0], jax.tree.map(lambda v: v[0], st), axis="ep", ragged=ragged)[None])
    seconds, _ = timers.time_batches(batched(xla_combine), (grouped, ws, states),
                                     repeats=args.repeats, method="host_clock")
    add("combine", "xla_baseline", seconds, **how)
    add_marginal("combine", "xla_baseline", xla_combine, (grouped, ws, states), seconds,
                 **how)
    breakdown("xla_baseline combine", batched(xla_combine), (grouped, ws, states))

  wire.clear()
  wire.update(plain)
  if ("xla_baseline" in args.backends and not shared_gpu and num_ranks > 1
      and devices[0].platform == "gpu"):  # no ragged all-to-all on CPU
    try:
      time_xla_baseline()
    except Exception as err:  # noqa: BLE001 -- XLA refuses some ragged modes at run time
      # Keep the records of the other backends; say what failed and how it was configured.
      print(f"xla_baseline (xla_ragged={XLA_RAGGED}, ragged_pieces={args.ragged_pieces}) "
            f"failed: {str(err).splitlines()[0][:400]}")

  if jax.process_index() == 0:
    path = reports.write_jsonl(records, args.out)
    reports.print_table(records, ["op", "backend", "wire_format", "fp8_quantized_by", "ranks",
                                 "process_model", "calls_per_run", "timing", "median_us",
                                 "gbps", "roofline"])
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
