"""The number a user's training step sees: N MoE layers (dispatch -> expert -> combine) in one
jitted program, with the group's default settings.

  python benchmarks/bench_layers.py                                        # one GPU: R = 1
  python -m jax_ep.launch -n 8 --share-gpu -- python benchmarks/bench_layers.py   # R = 8 on one
  python -m jax_ep.launch -n 2 -- python benchmarks/bench_layers.py       # one process per GPU

Each program is a `lax.scan` over N layers; a layer dispatches the running activations with
that layer's routing, applies the expert, combines, and feeds the result to the next layer. The
expert is `identity` (the received rows behind `lax.optimization_barrier`, so that XLA cannot
fold dispatch into combine: communication only) or `swiglu` (`jax_ep.mlp.expert_mlp` with one
set of expert weights shared by every layer, added to the layer's input as a residual). With
the identity expert a token's rows come back weighted by its router weights, which sum to one,
so the chain's activations keep their scale. With `--micro-batches n` each layer splits its
tokens into `n` equal runs, each with its own dispatch -> expert -> combine (as
`jax_ep.moe_mlp(..., micro_batches=n)` does) on a group sized for one micro-batch
(`max_tokens_per_rank = T / n`: its capacity per call `n` times smaller, the layer's memory the
unsplit one's); records carry `micro_batches` and that `capacity`. The time per
layer is marginal: `(t(2N) - t(N)) / N`, which leaves out what a program pays once (launch,
the processes' start skew, the first layer's wait for it). `host_clock_marginal` records take t
from the host clock around each run (the slowest process's median); `device_clock_marginal`
(GPU) from each run's device span in a profiler trace (the slowest device's median).

Backends: cuda, reference and plain XLA (`xla_baseline`: benchmarks/bench_local.py's gather
formulation at one rank, benchmarks/xla_pipeline.py's ragged all-to-all pipeline across ranks,
where XLA runs it: not on the CPU, not with processes sharing one GPU, whose XLA collectives
refuse to run; the reference backend needs XLA collectives too). `--debug-checks` adds the cuda
backend with `raise_on_timeout=True` (a host check after every op) beside the defaults;
`--comm-streams N` the cuda backend with its ops on XLA's additional stream N
(`Group(comm_stream=N)`; `jax_ep`: on jax_ep's own stream, the micro-batches in its pipeline),
whose records carry `comm_stream`. `--wire-formats plain fp8` times every group also with an fp8
`wire_format` (`Group(wire_format=jax_ep.RowFormat.FP8)`: dispatch sends each token as e4m3
with a scale per 128 channels, combine in bf16); its identity expert dequantises the rows inside
the groups (`jax_ep.dequantize(..., group_sizes=...)`) for combine, the least an expert does
with them; records carry
`wire_format` and `wire_dtype`, and `bytes` counts the e4m3 rows with their scales.
On a GPU each chain's program is first checked against the process's share of the GPU (alone,
XLA's allocator limit; shared by R processes, an R-th of the GPU): XLA's plan of its bytes and
the group's own buffers; one that does not fit is skipped on every process, saying why.
Records carry every setting that differs from a user's defaults (`settings`), and the
DESIGN.md section 6 keys; per layer, `bytes` counts the rows this rank receives in dispatch and
sends home in combine (one per token and rank each way) and `min_hbm_bytes` the least bytes both
ops move through one GPU's memory (R = 1 or emulation).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

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
from bench_local import xla_combine, xla_dispatch  # noqa: E402
from jax_ep.layer import expert_mlp  # noqa: E402


def chain_program(layer, num_layers: int, mesh, backward: bool = False):
  """`jit(shard_map(...))` of `num_layers` scanned layers over `(x, idx, w, *params)`, all split
  over the EP axis (`x`, `idx`, `w` with a leading rank axis; expert weights by expert).
  `layer(h, idx, w, params) -> h` is one layer on this shard's blocks. With `backward`, the
  program is a training step's share: the gradient of `sum(out)` with respect to the input,
  the router weights and the expert weights (forward and backward of every layer)."""
  def forward(x, idx, w, params):
    def step(h, routing):
      return layer(h, *routing, params), None
    out, _ = jax.lax.scan(step, x, (idx[:num_layers], w[:num_layers]))
    return out

  def body(x, idx, w, *params):
    if not backward:
      return (forward(x[0], idx[0], w[0], params)[None],)
    loss = lambda x, w, params: jnp.sum(forward(x, idx[0], w, params).astype(jnp.float32))
    dx, dw, dparams = jax.grad(loss, argnums=(0, 1, 2))(x[0], w[0], params)
    return (dx[None], dw[None], *dparams)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))


def micro_batched(layer, micro_batches: int):
  """`layer(h, idx, w, params)` on `micro_batches` equal runs of the shard's tokens, each its own
  dispatch -> expert -> combine, none reading another's results (as `jax_ep.moe_mlp`'s
  `micro_batches` splits them); `layer` itself for 1."""
  if micro_batches == 1:
    return layer

  def split_layer(h, idx, w, params):
    sizes = [h.shape[0] // micro_batches] * micro_batches
    parts = zip(*(jax.lax.split(a, sizes) for a in (h, idx, w)))
    return jnp.concatenate([layer(*part, params) for part in parts])
  return split_layer


def time_programs(programs, args, repeats: int, on_gpu: bool):
  """Per program: (host-clock median seconds, device-span median seconds or None). Every
  process makes the same calls whatever happens (collective kernels meet their peers)."""
  results = []
  for fn in programs:
    jax.block_until_ready(fn(*args))  # compile and warm up
    samples = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      samples.append(time.perf_counter() - start)
    device = None
    if on_gpu:
      try:
        spans = timers.device_run_spans(lambda _: fn(*args), repeats)
        if len(spans) >= max(3, repeats // 2):
          device = statistics.median(spans)
      except timers.TraceUnavailable as e:
        print(f"no device trace ({e})")
    results.append((statistics.median(samples), device))
  return results


def print_ratios(records, is_row, is_base, same_fields, describe):
  """For each record `is_row` picks, its median over that of the first `is_base` record that
  agrees with it on `same_fields`, printed after `describe(record)`."""
  for r in records:
    if not is_row(r):
      continue
    base = [q for q in records if is_base(q) and all(q[f] == r[f] for f in same_fields)]
    if base:
      print(f"{describe(r)}: {r['median_us'] / base[0]['median_us']:.3f} "
            f"({r['median_us']} / {base[0]['median_us']} us)")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
  parser.add_argument("--hidden", type=int, default=7168)
  parser.add_argument("--topk", type=int, default=8)
  parser.add_argument("--experts", type=int, default=256)
  parser.add_argument("--ffn", type=int, default=2048, help="the swiglu experts' inner size")
  parser.add_argument("--layers", type=int, default=4,
                      help="N: programs of N and 2N layers are timed")
  parser.add_argument("--expert", nargs="+", choices=["identity", "swiglu"],
                      default=["identity"])
  parser.add_argument("--passes", nargs="+", choices=["forward", "forward_backward"],
                      default=["forward"],
                      help="forward_backward: the gradient of the chain (a training step)")
  parser.add_argument("--capacities", nargs="+", choices=["default", "tight"],
                      default=["default"],
                      help="tight: also a group of buffer_factor=1.1 (10%% over a balanced "
                           "rank's T * K rows), timed beside the default in the same run")
  parser.add_argument("--backends", nargs="+", default=["cuda", "reference", "xla_baseline"],
                      choices=["cuda", "reference", "xla_baseline"])
  parser.add_argument("--debug-checks", action="store_true",
                      help="also time the cuda backend with raise_on_timeout=True")
  parser.add_argument("--virtual-hosts", type=int, nargs="+", default=[1],
                      help="cuda: also time groups whose ranks are split into this many virtual "
                           "hosts, their traffic between hosts on the network transport "
                           "(NVSHMEM); 1 is the group a user gets on one host")
  parser.add_argument("--micro-batches", type=int, nargs="+", default=[1],
                      help="split each layer's tokens into this many micro-batches, each with "
                           "its own dispatch -> expert -> combine (several values: each timed, "
                           "in the same run)")
  parser.add_argument("--comm-streams", type=lambda v: v if v == "jax_ep" else int(v),
                      nargs="+", default=[],
                      help="cuda: also time groups whose ops run on XLA's additional stream N "
                           "(Group(comm_stream=N)) beside the compute stream's kernels, or on "
                           "jax_ep's own (jax_ep: its pipeline interleaves the micro-batches)")
  parser.add_argument("--wire-formats", nargs="+", default=["plain"],
                      choices=[f.value for f in jax_ep.RowFormat],
                      help="the dispatch's wire formats (Group(wire_format=...)), each timed "
                           "for every group in the same run; plain is the default group's")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--breakdown", action="store_true",
                      help="print the device time per kernel of one 2N-layer run (GPU)")
  parser.add_argument("--out", default="layers.jsonl")
  args = parser.parse_args()
  if args.layers < 1:
    parser.error(f"--layers must be >= 1, got {args.layers}")
  if any(v < 1 for v in args.virtual_hosts):
    parser.error(f"--virtual-hosts must be >= 1, got {args.virtual_hosts}")
  if any(m < 1 or args.tokens % m for m in args.micro_batches):
    parser.error(f"--micro-batches must be positive and divide --tokens={args.tokens}, got "
                 f"{args.micro_batches}")

  devices = jax.devices()
  num_ranks = len(devices)
  on_gpu = devices[0].platform == "gpu"
  model = reports.process_model(num_ranks)
  shared_gpu = model == "shared_gpu"
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=devices)
  sharding = NamedSharding(mesh, P("ep"))
  t, h, k, e, n = args.tokens, args.hidden, args.topk, args.experts, args.layers
  num_local = e // num_ranks
  dtype = jnp.bfloat16

  def global_array(shape, make):
    """`[R, *shape]`; each process builds only the shards it holds, seeded per rank."""
    def shard(index):
      r = index[0].start or 0
      return make(np.random.default_rng([r, len(shape)]), r)[None]
    return jax.make_array_from_callback((num_ranks, *shape), sharding, shard)

  x = global_array((t, h), lambda rng, r: rng.standard_normal((t, h), np.float32).astype(dtype))
  idx = global_array((2 * n, t, k), lambda rng, r: np.stack(
      [reports.uniform_topk(rng, t, e, k) for _ in range(2 * n)]))

  def normalized_weights(rng, r):
    w = rng.random((2 * n, t, k)).astype(np.float32) + 0.1
    return w / w.sum(-1, keepdims=True)
  w = global_array((2 * n, t, k), normalized_weights)

  # Field accounting (uniform routing): a token reaches a rank once whatever its slots there.
  routing0 = np.stack([reports.uniform_topk(np.random.default_rng([r, 3]), t, e, k)
                       for r in range(num_ranks)])
  dest = routing0 // num_local
  recv_tokens = np.mean([np.sum(np.any(dest == r, axis=-1)) for r in range(num_ranks)])
  row_bytes = h * 2
  slot_rows = num_ranks * t * k

  def round_trip_bytes(fmt):
    """One row both ways: dispatch sends it as `H` bf16 values or `H` e4m3 bytes with their
    scales (sizing.low_latency_row_bytes), combine sends it home in bf16."""
    return jax_ep.sizing.low_latency_row_bytes(fmt, h, dtype) + row_bytes

  def accounting(fmt):
    """The byte fields of a wire format: the rows this rank receives in dispatch and sends
    home in combine; both read and write the tokens in bf16."""
    return dict(bytes=int(recv_tokens * round_trip_bytes(fmt)),
                min_hbm_bytes=2 * num_ranks * t * row_bytes + slot_rows * round_trip_bytes(fmt),
                wire_dtype="float8_e4m3fn" if fmt.is_fp8 else "bfloat16",
                wire_format=fmt.value)
  capacity = jax_ep.default_capacity(num_ranks, t, k, num_local)  # every group's default
  one_gpu = model in ("shared_gpu", "single_device")
  bound_gbps, bound = (bounds.copy_bound_gbps() if jax.process_index() == 0
                       else (0.0, "copy"))
  bound_gbps = reports.gather_max("bound", bound_gbps)

  def expert_params(rng_key):
    """`[E, H, F]`, `[E, H, F]`, `[E, F, H]` drawn on the devices, each process its shards."""
    spec = NamedSharding(mesh, P("ep"))
    shapes = [((e, h, args.ffn), h ** -0.5), ((e, h, args.ffn), h ** -0.5),
              ((e, args.ffn, h), args.ffn ** -0.5)]
    keys = jax.random.split(rng_key, len(shapes))
    return [jax.jit(lambda key, shape=shape, scale=scale: (
        jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype),
        out_shardings=spec)(key) for key, (shape, scale) in zip(keys, shapes)]

  records = reports.Records(args.out)
  base = dict(op="layer_chain", mode="high_throughput", ranks=num_ranks, process_model=model,
              tokens_per_rank=t, hidden=h, topk=k, experts=e, dtype="bfloat16", layers=n,
              bound_gbps=round(bound_gbps, 1), bound=bound)

  def paths(topology, fmt):
    """The record's split of `bytes` into the rows that took the network path and those that
    took the peer path (reports.high_throughput_paths), both ways."""
    network, peer = reports.high_throughput_paths(dest, topology)
    both = round_trip_bytes(fmt)
    return dict(hosts=topology.num_hosts if topology else 1,
                gpus_per_host=list(topology.gpus_per_host) if topology else [num_ranks],
                network_bytes=int(network * both), peer_bytes=int(peer * both))

  def add(backend, expert, results, settings, topology=None, capacity=capacity,
          pass_="forward", micro_batches=1, comm_stream=None, fmt=jax_ep.RowFormat.PLAIN):
    (host_n, dev_n), (host_2n, dev_2n) = results
    split = f" micro_batches={micro_batches}" if micro_batches != 1 else ""
    for timing, first, second in (("host_clock_marginal", host_n, host_2n),
                                  ("device_clock_marginal", dev_n, dev_2n)):
      # Every process gathers every value (a missing one as infinity), so that all of them
      # make the same key-value store calls and take the same branch.
      key = f"{backend}/{expert}/{settings}/{pass_}/{micro_batches}/{timing}"
      first = reports.gather_max(f"{key}/n", math.inf if first is None else first)
      second = reports.gather_max(f"{key}/2n", math.inf if second is None else second)
      if math.isinf(first) or math.isinf(second):
        continue
      per_layer_us = (second - first) / n * 1e6
      if per_layer_us <= 0:
        print(f"{backend} {expert}{split}: no {timing} record (t(2N) <= t(N): timing noise)")
        continue
      wire = accounting(fmt)
      roofline = (wire["min_hbm_bytes"] / (bound_gbps * 1e9) / (per_layer_us * 1e-6) if one_gpu
                  else wire["bytes"] / (per_layer_us * 1e-6) / 1e9 / bound_gbps)
      records.append(reports.record(
          **base, **wire, backend=backend, expert=expert, timing=timing,
          median_us=round(per_layer_us, 1), program_us=round(second * 1e6, 1),
          gbps=round(wire["bytes"] / (per_layer_us * 1e-6) / 1e9, 1),
          roofline=round(roofline, 3), settings=settings,
          raise_on_timeout=settings == "debug_checks", capacity=capacity, **{"pass": pass_},
          micro_batches=micro_batches, comm_stream=comm_stream, **paths(topology, fmt)))

  params = expert_params(jax.random.key(0)) if "swiglu" in args.expert else []

  def run(backend, expert, layer, settings="default", topology=None, capacity=capacity,
          micro_batches=1, comm_stream=None, fmt=jax_ep.RowFormat.PLAIN, reserved_bytes=0):
    for pass_ in args.passes:
      backward = pass_ == "forward_backward"
      programs = [chain_program(layer, layers, mesh, backward) for layers in (n, 2 * n)]
      inputs = (x, idx, w, *(params if expert == "swiglu" else ()))
      what = f"{backend} {expert} ({settings}, {pass_}, micro_batches={micro_batches})"
      key = f"{backend}/{expert}/{settings}/{pass_}/{micro_batches}"
      # The larger program, of 2N layers, checked for both.
      if not reports.fits_gpu(programs[1], inputs, key, f"{what}, {2 * n} layers",
                              sharing=num_ranks if shared_gpu else 1,
                              reserved_bytes=reserved_bytes,
                              hint="fewer --tokens or --layers fit"):
        continue
      try:
        results = time_programs(programs, inputs, args.repeats, on_gpu)
        failed = 0.0
      except Exception as err:  # noqa: BLE001 - e.g. a layer that does not fit; the others run
        print(f"{what}: failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        failed = 1.0
      # All processes skip a layer that failed on any (its collectives would not meet).
      if reports.gather_max(f"{key}/failed", failed) > 0:
        continue
      add(backend, expert, results, settings, topology, capacity, pass_, micro_batches,
          comm_stream, fmt)
      if args.breakdown and on_gpu:
        rows, activity = timers.trace_breakdown(programs[1], inputs)
        if jax.process_index() == 0:
          print(f"{what}: device time per layer by kernel (process 0; us, launches)")
          for name, us, launches in rows[:12]:
            print(f"  {us / (2 * n):9.1f}  {launches / (2 * n):4.1f}  {name[:90]}")
          for plane, busy, span in activity:
            print(f"  {plane}: busy {busy / (2 * n):.1f} us of {span / (2 * n):.1f} us per "
                  "layer")

  def apply_expert(expert, rows, sizes, p, scales=None, offsets=None):
    if scales is not None:  # an fp8 wire: the rows for combine, or for the bf16 experts
      rows = jax_ep.dequantize(rows, scales, dtype, group_sizes=sizes, group_offsets=offsets)
    if expert == "identity":
      return jax.lax.optimization_barrier(rows)
    return expert_mlp(rows, *p, sizes)

  variants = []
  for b in args.backends:
    if b == "xla_baseline":
      continue
    variants += [(b, "default", {})] if "default" in args.capacities else []
    # The tight group: what a user who sizes for balanced routing passes.
    variants += ([(b, "buffer_factor=1.1", {"buffer_factor": 1.1})]
                 if "tight" in args.capacities else [])
  if args.debug_checks and "cuda" in args.backends:
    variants.append(("cuda", "debug_checks", {"raise_on_timeout": True}))
  if "cuda" in args.backends:
    variants += [("cuda", f"virtual_hosts={v}", {"virtual_hosts": v})
                 for v in args.virtual_hosts if v > 1]
    variants += [("cuda", f"comm_stream={s}", {"comm_stream": s}) for s in args.comm_streams]
  # Each group again with every fp8 wire format asked for.
  def with_wire(backend, settings, kw, fmt):
    if not fmt.is_fp8:
      return backend, settings, kw, fmt
    wire = f"wire_format={fmt.value}"
    return (backend, wire if settings == "default" else f"{settings},{wire}",
            dict(kw, wire_format=fmt), fmt)
  formats = [jax_ep.RowFormat(f) for f in dict.fromkeys(args.wire_formats)]
  variants = [with_wire(*v, fmt) for v in variants for fmt in formats]
  for (backend, settings, kw, fmt), micro_batches in itertools.product(variants,
                                                                       args.micro_batches):
    if backend == "reference" and shared_gpu and num_ranks > 1:
      print("reference: skipped (processes sharing one GPU cannot run XLA collectives)")
      continue
    # The cuda rows use the group a user gets (backend="auto"), which must have picked cuda,
    # sized for one micro-batch: each of its calls takes t / n tokens, so its capacity (per
    # call) is n times smaller and the layer keeps what the unsplit layer keeps.
    try:
      group = jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h,
                           max_tokens_per_rank=t // micro_batches, dtype=dtype,
                           backend="auto" if backend == "cuda" else backend, **kw)
    except ValueError as err:
      if "virtual_hosts" not in kw:
        raise
      # Every process decides alike (the same mesh and build), so all skip it together.
      print(f"cuda ({settings}): unavailable here: {err}")
      continue
    if group.backend_name != backend:
      print(f"{backend}: unavailable here (backend='auto' picked {group.backend_name}: "
            f"{group.backend_reason})")
      group.close()
      continue
    for expert in args.expert:
      def layer(hid, i, wt, p, group=group, expert=expert):
        recv, handle = jax_ep.dispatch(group, hid, i, wt)
        out = jax_ep.combine(group, apply_expert(expert, recv.x, recv.group_sizes, p,
                                                 recv.scales, recv.group_offsets), handle)
        return out if expert == "identity" else hid + out
      run(backend, expert, micro_batched(layer, micro_batches), settings, group.topology,
          group.capacity, micro_batches, kw.get("comm_stream"), fmt,
          reports.comm_buffer_bytes(group))
    # One group's buffers at a time: at the standard shape each is several GB per rank, and
    # ranks sharing one GPU hold theirs side by side. Every process is past its last call of
    # this group here (each run ends in block_until_ready and a gather).
    group.close()

  if "xla_baseline" in args.backends:
    if num_ranks > 1 and (not on_gpu or shared_gpu):
      print("xla_baseline: skipped (its ragged all-to-all needs XLA's GPU collectives, which "
            "neither the CPU nor processes sharing one GPU have)")
    else:
      for expert in args.expert:
        def layer(hid, i, wt, p, expert=expert):
          if num_ranks == 1:
            rows, sizes, order = xla_dispatch(hid, i, e)
            out = xla_combine(apply_expert(expert, rows, sizes, p), order, wt)
          else:
            rows, sizes, state = xla_pipeline.dispatch(hid, i, axis="ep", num_ranks=num_ranks,
                                                       num_experts=e)
            out = xla_pipeline.combine(apply_expert(expert, rows, sizes, p), wt, state,
                                       axis="ep")
          return out if expert == "identity" else hid + out
        for micro_batches in args.micro_batches:
          run("xla_baseline", expert, micro_batched(layer, micro_batches),
              micro_batches=micro_batches)

  if jax.process_index() == 0:
    path = records.path
    reports.print_table(records, ["backend", "expert", "settings", "pass", "micro_batches",
                                 "comm_stream", "timing", "layers", "capacity", "median_us",
                                 "program_us", "gbps", "roofline"])
    # Ratios side by side (the same run). Default against tight capacity: what the
    # worst-case default costs in time.
    print_ratios(records, lambda r: r["settings"] == "default",
                 lambda q: q["settings"] == "buffer_factor=1.1",
                 ("backend", "expert", "pass", "micro_batches", "timing"),
                 lambda r: f"default / tight: {r['backend']} {r['expert']} {r['pass']} "
                           f"{r['timing']}")
    # Split against unsplit: what the micro-batches buy.
    print_ratios(records, lambda r: r["micro_batches"] != 1,
                 lambda q: q["micro_batches"] == 1,
                 ("backend", "expert", "settings", "pass", "timing"),
                 lambda r: f"micro_batches={r['micro_batches']} / 1: {r['backend']} "
                           f"{r['expert']} {r['settings']} {r['pass']} {r['timing']}")
    # Each op on its own stream against the compute stream.
    print_ratios(records, lambda r: r["comm_stream"] is not None,
                 lambda q: q["settings"] == "default",
                 ("backend", "expert", "pass", "micro_batches", "timing"),
                 lambda r: f"comm_stream={r['comm_stream']} / compute stream: {r['expert']} "
                           f"{r['pass']} micro_batches={r['micro_batches']} {r['timing']}")
    # The fp8 wire against bf16 rows: what sending e4m3 buys the chain.
    print_ratios(records, lambda r: r["settings"] == f"wire_format={r['wire_format']}",
                 lambda q: q["wire_format"] == "plain" and q["settings"] == "default",
                 ("backend", "expert", "pass", "micro_batches", "timing"),
                 lambda r: f"wire_format={r['wire_format']} / plain: {r['backend']} "
                           f"{r['expert']} {r['pass']} {r['timing']}")
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
