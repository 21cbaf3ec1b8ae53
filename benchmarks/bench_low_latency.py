"""The decode path: the low-latency pair, per op (device clock) and as a chain of layers.

  python benchmarks/bench_low_latency.py                                         # R = 1
  python -m jax_ep.launch -n 8 --share-gpu -- python benchmarks/bench_low_latency.py  # R = 8 on one
  python -m jax_ep.launch -n 2 -- python benchmarks/bench_low_latency.py         # one per GPU

For each tokens-per-rank T (T_max = T) and each dispatch format (fp8: e4m3 rows with one scale
per 128 channels; bf16), with combine in bf16 and the group's defaults otherwise:
- `chain`: N layers of dispatch -> expert -> combine in one jitted `lax.scan`, marginal per
  layer `(t(2N) - t(N)) / N` from each run's device span (the slowest device's median). The
  expert is the identity on bf16 rows (`recv.x` itself); after an fp8 dispatch it is a fixed
  bf16 slab (a dequantisation of the whole `[L, R*T_max, H]` slab, mostly padding, would time
  XLA's elementwise pass, not the transport).
- `dispatch`, `combine`, `dispatch_send`, `dispatch_wait`, `combine_send`, `combine_wait`: the
  device time of the op's kernels per layer, from profiler traces of the same chains, marginal
  between N and 2N layers (median of three; the waits include waiting for the peers' sends).
- `fp8_error`: the relative error of an fp8 dispatch -> identity -> combine round trip against
  the bf16 one (the end-to-end cost of fp8 on the wire), max over elements, relative to the
  largest output.
Records follow DESIGN.md section 6 (`mode: "low_latency"`); `bytes` counts one row per selected
slot this rank sends (the field's accounting), `roofline` the share of the same run's copy bound
(one GPU's, measured by one process) that writing and reading those rows once would take, summed
over the ranks when they share that GPU (`min_hbm_bytes`).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

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

# Each op's kernels, by the names the profiler shows (ffi/kernels/low_latency_*.cu).
# A send includes the network transport's put kernel where the group has one. At one rank the
# fused ops run one kernel each, with no send / wait split (`*_local`, counted in the op's
# total only).
KERNELS = {"dispatch_send": ("DispatchSendKernel", "DispatchPutKernel"),
           "dispatch_wait": ("DispatchFlagsKernel", "DispatchPackKernel"),
           "dispatch_local": ("DispatchLocalKernel",),
           "combine_send": ("CombineSendKernel", "CombinePutKernel"),
           "combine_wait": ("CombineFlagsKernel", "CombineReduceKernel"),
           "combine_local": ("CombineLocalKernel",)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128, 256])
  parser.add_argument("--hidden", type=int, default=7168)
  parser.add_argument("--topk", type=int, default=8)
  parser.add_argument("--experts", type=int, default=256)
  parser.add_argument("--formats", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
  parser.add_argument("--layers", type=int, default=4, help="N: chains of N and 2N layers")
  parser.add_argument("--repeats", type=int, default=9)
  parser.add_argument("--num-sms", type=int, default=None,
                      help="the group's SM budget (default: the group's default)")
  parser.add_argument("--virtual-hosts", type=int, default=None,
                      help="split the ranks into this many virtual hosts whose traffic between "
                           "them takes the network transport (NVSHMEM puts)")
  parser.add_argument("--out", default="low_latency.jsonl")
  args = parser.parse_args()

  devices = jax.devices()
  r = len(devices)
  on_gpu = devices[0].platform == "gpu"
  mesh = jax.make_mesh((r,), ("ep",), devices=devices)
  sharding = NamedSharding(mesh, P("ep"))
  h, k, e = args.hidden, args.topk, args.experts
  num_local = e // r
  # The copy bound of one GPU, measured by one process alone (ranks sharing a GPU would each
  # measure a share of it while the others copy); the roofline's bytes are those that GPU moves.
  one_gpu = reports.process_model(r) in ("shared_gpu", "single_device")
  if on_gpu:
    bound_gbps, bound_how = (bounds.copy_bound_gbps() if jax.process_index() == 0
                             else (0.0, "cudaMemcpy"))
    bound_gbps = reports.gather_max("bound", bound_gbps, timeout_s=400)
  else:
    bound_gbps, bound_how = math.nan, "none"
  gpu_ranks = r if one_gpu else 1  # the ranks whose rows one GPU's memory moves
  records = []
  settings = {} if args.num_sms is None else {"num_sms": args.num_sms}
  if args.virtual_hosts not in (None, 1):
    settings["virtual_hosts"] = args.virtual_hosts

  def global_array(shape, make):
    def shard(index):
      rank = index[0].start or 0
      return make(np.random.default_rng(1000 + rank), shape[1:])[None]
    return jax.make_array_from_callback((r, *shape[1:]), sharding, shard)

  for t in args.tokens:
    group = jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
                         dtype=jnp.bfloat16, low_latency=True, **settings)
    slab = group.config.low_latency_slab
    x = global_array((r, t, h), lambda g, s: g.standard_normal(s).astype(jnp.bfloat16))
    idx = global_array((r, 2 * args.layers, t, k), lambda g, s: np.stack(
        [reports.uniform_topk(g, t, e, k) for _ in range(s[0])]))
    w = global_array((r, 2 * args.layers, t, k),
                     lambda g, s: (g.random(s) / k).astype(np.float32))
    fixed = global_array((r, num_local, slab, h),
                         lambda g, s: np.full(s, 0.01, jnp.bfloat16))

    def layer(hid, i, wt, eo_fixed, fmt):
      recv, handle = jax_ep.low_latency_dispatch(
          group, hid, i, row_format=jax_ep.RowFormat.FP8 if fmt == "fp8" else None)
      eo = recv.x if fmt == "bf16" else eo_fixed
      return jax_ep.low_latency_combine(group, eo, handle, wt)

    def chain(num_layers, fmt):
      def body(x, idx, w, fixed):
        def step(hid, routing):
          return layer(hid, *routing, fixed[0], fmt), None
        out, _ = jax.lax.scan(step, x[0], (idx[0, :num_layers], w[0, :num_layers]))
        return out[None]
      return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))

    inputs = (x, idx, w, fixed)
    outs = {}
    # Hosts, and the share of this rank's slots whose expert lives on another host (first
    # layer's routing): the bytes that take the network path, beside those of the peer path.
    topo = group.topology
    hosts = topo.num_hosts if topo is not None else 1
    gpus_per_host = list(topo.gpus_per_host) if topo is not None else [r]
    network_share = 0.0
    if topo is not None:
      me = jax.process_index()
      mine = np.asarray(idx.addressable_shards[0].data)[0, 0]
      dest = mine[mine >= 0] // num_local
      network_share = float(np.mean([topo.host_of(int(d)) != topo.host_of(me) for d in dest]))

    def paths(nbytes):
      network = round(nbytes * network_share)
      return dict(network_bytes=network, peer_bytes=nbytes - network)

    for fmt in args.formats:
      row_bytes = h + 4 * (h // 128) if fmt == "fp8" else 2 * h
      dispatch_bytes, combine_bytes = t * k * row_bytes, t * k * 2 * h
      base = dict(mode="low_latency", backend=group.backend_name, op=None, ranks=r,
                  tokens_per_rank=t, hidden=h, experts=e, topk=k, dtype="bfloat16",
                  wire_dtype="float8_e4m3fn" if fmt == "fp8" else "bfloat16",
                  dispatch_format=fmt, combine_format="bf16",
                  process_model=reports.process_model(r), hosts=hosts,
                  gpus_per_host=gpus_per_host, bound_gbps=round(bound_gbps, 1),
                  bound=bound_how, settings=settings or "default")
      # The chain: marginal device time per layer.
      spans, fns = {}, {}
      for num_layers in (args.layers, 2 * args.layers):
        fn = fns[num_layers] = chain(num_layers, fmt)
        outs[(fmt, num_layers)] = jax.block_until_ready(fn(*inputs))
        value = math.inf
        if on_gpu:
          try:
            runs = timers.device_run_spans(lambda _, fn=fn: fn(*inputs), args.repeats)
            if len(runs) >= max(3, args.repeats // 2):
              value = statistics.median(runs)
          except timers.TraceUnavailable as err:
            print(f"no device trace ({err})")
        spans[num_layers] = reports.gather_max(f"ll/{t}/{fmt}/chain/{num_layers}", value)
      per_layer = (spans[2 * args.layers] - spans[args.layers]) / args.layers
      if math.isfinite(per_layer) and per_layer > 0:
        nbytes = dispatch_bytes + combine_bytes
        records.append(reports.record(
            **dict(base, op="chain"), timing="device_clock_marginal", layers=args.layers,
            median_us=round(per_layer * 1e6, 1), bytes=nbytes, **paths(nbytes),
            min_hbm_bytes=2 * gpu_ranks * nbytes, gbps=round(nbytes / per_layer / 1e9, 1),
            roofline=round(2 * gpu_ranks * nbytes / (bound_gbps * 1e9) / per_layer, 3)))
      # Per op: its kernels' device time per layer, marginal between the chains of N and 2N
      # layers like the chain's (the first layer's wait also waits out the processes' skew in
      # starting the program, which says nothing about the op).
      per_kernel = {name: [] for name in KERNELS}
      for _ in range(3):
        sums = []
        for num_layers in (args.layers, 2 * args.layers):
          rows = timers.kernel_breakdown(fns[num_layers], inputs,
                                         repeats=max(3, args.repeats // 3))
          sums.append({name: sum(us for n, us, _ in rows if any(kn in n for kn in kernels))
                       for name, kernels in KERNELS.items()})
        for name in KERNELS:
          per_kernel[name].append((sums[1][name] - sums[0][name]) / args.layers)
      times = {name: reports.gather_max(f"ll/{t}/{fmt}/{name}", statistics.median(v))
               for name, v in per_kernel.items()}
      times["dispatch"] = (times["dispatch_send"] + times["dispatch_wait"]
                           + times.pop("dispatch_local"))
      times["combine"] = (times["combine_send"] + times["combine_wait"]
                          + times.pop("combine_local"))
      for op, us in times.items():
        if not us > 0:
          continue
        nbytes = dispatch_bytes if op.startswith("dispatch") else combine_bytes
        records.append(reports.record(
            **dict(base, op=op), timing="device_kernels_marginal", median_us=round(us, 1),
            bytes=nbytes, **paths(nbytes), min_hbm_bytes=2 * gpu_ranks * nbytes,
            gbps=round(nbytes / (us * 1e-6) / 1e9, 1),
            roofline=round(2 * gpu_ranks * nbytes / (bound_gbps * 1e9) / (us * 1e-6), 3)))
    if "fp8" in args.formats:
      def roundtrip(fp8):
        def body(x, i, wt):
          recv, handle = jax_ep.low_latency_dispatch(
              group, x[0], i[0, 0], row_format=jax_ep.RowFormat.FP8 if fp8 else None)
          rows = recv.x.astype(jnp.float32)
          if fp8:
            rows = (rows.reshape(*rows.shape[:-1], -1, 128) * recv.scales[..., None]).reshape(
                rows.shape)
          used = jnp.arange(slab)[None, :, None] < recv.count[:, None, None]
          eo = jnp.where(used, rows, 0.0).astype(jnp.bfloat16)
          return jax_ep.low_latency_combine(group, eo, handle, wt[0, 0])[None]
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
        return np.asarray(fn(x, idx, w).addressable_shards[0].data, np.float32)
      q, ref = roundtrip(True), roundtrip(False)
      err = float(np.abs(q - ref).max() / max(np.abs(ref).max(), 1e-30))
      records.append(reports.record(
          mode="low_latency", backend=group.backend_name, op="fp8_error", ranks=r,
          tokens_per_rank=t, hidden=h, experts=e, topk=k, dtype="bfloat16",
          process_model=reports.process_model(r), max_rel_error=round(err, 5),
          settings=settings or "default"))
    group.close()

  if jax.process_index() == 0:
    reports.print_table(records, ["op", "tokens_per_rank", "dispatch_format", "median_us",
                                  "bytes", "roofline", "max_rel_error"])
    print("wrote", reports.write_jsonl(records, args.out))


if __name__ == "__main__":
  main()
