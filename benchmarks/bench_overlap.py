"""How much of a layer's communication hides behind its expert GEMMs, at one rank.

  python benchmarks/bench_overlap.py                 # DeepSeek-V3 at EP=8, one rank's shape
  python benchmarks/bench_overlap.py --passes forward forward_backward --comm-streams 1 jax_ep

Two independent halves of a micro-batched layer, as `moe_mlp(..., micro_batches=2)` places
them: the experts of one micro-batch (`jax_ep.expert_mlp` on its received rows; `gemm`) and the
dispatch -> combine of the other (`comm`: T tokens, top-K of E experts, H channels; the
identity between them). Three programs, each timed by its device span (the profiler): `gemm`
alone, `comm` alone and `both` in one program; with the ops on XLA's compute stream (the
default group) and on the additional stream N (`Group(comm_stream=N)`), in the same run.
`--num-sms 24 132`: on jax_ep's own stream, each SM budget (`Group(num_sms=...)`) side by side
(the process's first group sizes the own stream's SM partition, `own_stream_partition_sms` in
the records; `JAX_EP_OWN_STREAM_PARTITION=0` runs it on every SM instead).
`--kernel-sms all 108 1056`: the expert kernels' persistent grid
(`jax_ep.experts.override(kernel_sms=...)`) side by side.
`--timeline PATH`: the kernels of one run of `both` and of `gemm` per setting (the device
timeline: stream, start, duration), written to PATH (`both`'s drawn as one row per stream),
with the host's events of that run that took 5 us or more (XLA's thunks, the handlers, the
CUDA API calls: where a stream waits on the host).
Records (`op: overlap`) carry the three times, the hidden fraction
`(t_gemm + t_comm - t_both) / t_comm` and the GEMMs' slowdown while they share the GPU with
the communication kernels: the device time of the non-jax_ep kernels in `both` over that in
`gemm` (per run, medians; the comm half's own XLA kernels, from `comm` alone, taken out), and
the streams each side's kernels ran on. With `forward_backward` each half is differentiated:
the experts' forward and backward, and the ops' forward and backward (dispatch, combine, their
transposes).

On jax_ep's own stream (`--comm-streams jax_ep`, `Group(comm_stream="jax_ep")`) the ops overlap
only where jax_ep's pipeline (jax_ep/overlap.py) interleaves them with other work, so the
programs are the layer's (`program: pipeline`): `both` is two micro-batches of T tokens, each
dispatch -> `expert_mlp` -> combine, as `moe_mlp(..., micro_batches=2)` runs them there; `gemm`
their experts alone on the rows their dispatches received; `comm` their dispatches and combines
alone (the identity between).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reports  # noqa: E402
import timers  # noqa: E402
import jax_ep  # noqa: E402
from jax_ep import overlap  # noqa: E402
from jax_ep._native import ffi, own_stream  # noqa: E402
from jax_ep.backends.options import OWN_STREAM  # noqa: E402


def is_comm(kernel: str) -> bool:
  """Whether a traced kernel is one of the ops' (the CUDA kernels, in namespace `jax_ep::`),
  not the experts' (`jax_ep_gmm_ws_mosaic_gpu_kernel`, ...) or XLA's."""
  return "jax_ep::" in kernel


def kernel_times(run, repeats: int):
  """Per run, from a profiler trace: (span, device time of the ops' kernels, of the others),
  seconds; the streams the ops' kernels and the others ran on; and the kernels of the run of
  median span, `(start_ns, end_ns, name, stream)` (`timeline`), with the host's events in its
  span (`host_timeline`: what the host did while a stream waited)."""
  host: list = []
  events = [(s, e, name, line) for name, s, e, line in timers._traced_events(
      run, repeats, with_stream=True, host=host)]
  spans = timers.split_runs([(s, e, name) for s, e, name, _ in events], repeats)
  runs = timers.group_runs(events, repeats)
  ours = [sum(e - s for s, e, name, _ in r if is_comm(name)) * 1e-9 for r in runs]
  others = [sum(e - s for s, e, name, _ in r if not is_comm(name)) * 1e-9 for r in runs]
  streams = ({line for _, _, name, line in events if is_comm(name)},
             {line for _, _, name, line in events if not is_comm(name)})
  by_span = sorted(runs, key=lambda r: max(e for _, e, _, _ in r) - r[0][0])
  median = by_span[len(by_span) // 2] if by_span else []
  near = []
  if median:
    t0, t1 = min(s for s, _, _, _ in median), max(e for _, e, _, _ in median)
    near = [(s, e, name, line) for name, s, e, line in host if s < t1 and e > t0 - 200_000]
  return spans, ours, others, streams, (median, near)


def host_timeline(events, t0: int, min_us: float = 5.0, limit: int = 600) -> list[dict]:
  """The host's events of one run (XLA's thunks and custom calls, the CUDA API calls) that
  took at least `min_us`, relative to the run's first kernel: `{thread, start_us, us, name}`,
  the first `limit` in time order. A stream that waits while the host is inside a call (a
  handler, a launch, a synchronisation) shows here."""
  listed = [dict(thread=line, start_us=round((s - t0) * 1e-3, 2), us=round((e - s) * 1e-3, 2),
                 name=name[:120]) for s, e, name, line in sorted(events)
            if (e - s) * 1e-3 >= min_us]
  return listed[:limit]


def timeline(kernels, width: int = 100) -> tuple[list[dict], list[str]]:
  """One run's kernels relative to its first start, `{stream, start_us, us, name, ours}` each,
  and a text picture of them: one row per stream, `width` columns over the run's span, `#`
  where one of the ops' kernels runs, `=` where another kernel does (`#` wins a shared one)."""
  if not kernels:
    return [], []
  t0, t1 = min(s for s, _, _, _ in kernels), max(e for _, e, _, _ in kernels)
  rows: dict = {}
  listed = []
  for s, e, name, stream in sorted(kernels):
    listed.append(dict(stream=stream, start_us=round((s - t0) * 1e-3, 2),
                       us=round((e - s) * 1e-3, 2), name=name, ours=is_comm(name)))
    row = rows.setdefault(stream, [" "] * width)
    lo = int((s - t0) * width / max(t1 - t0, 1))
    hi = max(lo + 1, int((e - t0) * width / max(t1 - t0, 1)))
    for i in range(lo, min(hi, width)):
      if row[i] != "#":
        row[i] = "#" if is_comm(name) else "="
  picture = [f"{stream[:24]:24s} |{''.join(row)}|" for stream, row in sorted(rows.items())]
  picture.append(f"{'':24s}  0{(t1 - t0) * 1e-3:>{width - 1}.0f} us")
  return listed, picture


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=4096, help="T: one micro-batch's tokens")
  ap.add_argument("--experts", type=int, default=32, help="E: the rank's experts")
  ap.add_argument("--hidden", type=int, default=7168)
  ap.add_argument("--ffn", type=int, default=2048)
  ap.add_argument("--topk", type=int, default=8)
  ap.add_argument("--passes", nargs="+", choices=["forward", "forward_backward"],
                  default=["forward", "forward_backward"])
  ap.add_argument("--comm-streams", type=lambda v: v if v == OWN_STREAM else int(v), nargs="+",
                  default=[1, OWN_STREAM],
                  help=f"the additional streams to time beside the compute stream (an int N "
                       f"for XLA's stream N, {OWN_STREAM!r} for jax_ep's own and its pipeline)")
  ap.add_argument("--num-sms", type=int, nargs="+", default=[24],
                  help="the groups' num_sms (default the Group's): on jax_ep's own stream each "
                       "value is timed (the SMs an op's grids are sized to there); elsewhere "
                       "the first")
  ap.add_argument("--kernel-sms", type=lambda v: None if v == "all" else int(v), nargs="+",
                  default=[None], help="the expert kernels' persistent grid, each side by side "
                  "('all': every SM, the default; N: `jax_ep.experts.override(kernel_sms=N)`)")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--timeline", default=None,
                  help="write the kernels of one run of `both` (median span) per setting and "
                       "pass to this JSON file, and print each as one row per stream")
  ap.add_argument("--host-clock", action="store_true",
                  help="time by the host clock on a GPU too (no profiler trace): for runs under "
                       "ncu, whose own profiling the trace would contend with")
  ap.add_argument("--out", default="overlap.jsonl")
  a = ap.parse_args()
  on_gpu = jax.devices()[0].platform == "gpu" and not a.host_clock
  t, e, h, f, k = a.tokens, a.experts, a.hidden, a.ffn, a.topk
  rng = np.random.default_rng(0)
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  dtype = jnp.bfloat16
  # Drawn on the device: the experts' weights alone are ~1.4 G values.
  keys = iter(jax.random.split(jax.random.key(0), 6))
  normal = lambda shape, scale=1.0: (jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
                                     * scale).astype(dtype)
  x = normal((t, h))
  idx = jnp.asarray(reports.uniform_topk(rng, t, e, k))
  w = jnp.asarray(rng.random((t, k)), jnp.float32)
  params = [normal(shape, shape[1] ** -0.5) for shape in ((e, h, f), (e, h, f), (e, f, h))]
  # The other micro-batch's received rows and their experts' sizes, as its dispatch left them.
  counts = np.bincount(np.asarray(idx).ravel(), minlength=e).astype(np.int32)
  rows = normal((int(counts.sum()), h))
  sizes = jnp.asarray(counts)

  def experts(rows, params):
    return jax_ep.expert_mlp(rows, *params, sizes)

  def programs(group, backward):
    def comm(x, w):
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      return jax_ep.combine(group, recv.x, handle)
    if backward:
      sq = lambda fn: lambda *args: jnp.sum(fn(*args).astype(jnp.float32) ** 2)
      gemm_fn, comm_fn = jax.grad(sq(experts), (0, 1)), jax.grad(sq(comm), (0, 1))
    else:
      gemm_fn, comm_fn = experts, comm
    shard = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(),
                                             check_vma=False))
    if group.options.comm_stream == OWN_STREAM:
      return pipeline_programs(group, backward)
    progs = {"gemm": shard(lambda x, w, rows, p: gemm_fn(rows, p)),
             "comm": shard(lambda x, w, rows, p: comm_fn(x, w)),
             "both": shard(lambda x, w, rows, p: (comm_fn(x, w), gemm_fn(rows, p)))}
    return {name: (lambda fn=fn: fn(x, w, rows, params)) for name, fn in progs.items()}

  # The pipeline's second micro-batch.
  x2 = normal((t, h))
  idx2 = jnp.asarray(reports.uniform_topk(rng, t, e, k))
  w2 = jnp.asarray(rng.random((t, k)), jnp.float32)

  def pipeline_programs(group, backward):
    def one(p, part, idx):
      x, w = part
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      y = jax_ep.expert_mlp(recv.x, *p, recv.group_sizes, group_offsets=recv.group_offsets)
      return jax_ep.combine(group, y, handle), ()

    def layer(x, x2, w, w2, p, received):
      return overlap.pipeline(one, p, [(x, w), (x2, w2)], [idx, idx2])[0]

    def comm(x, x2, w, w2, p, received):
      def one_comm(x, idx, w):
        recv, handle = jax_ep.dispatch(group, x, idx, w)
        return jax_ep.combine(group, recv.x, handle)
      return [one_comm(x, idx, w), one_comm(x2, idx2, w2)]

    def gemm(x, x2, w, w2, p, received):
      return [jax_ep.expert_mlp(r.x, *p, r.group_sizes, group_offsets=r.group_offsets)
              for r in received]
    if backward:
      sq = lambda fn: lambda *args: sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in fn(*args))
      layer, comm, gemm = (jax.grad(sq(fn), (0, 1, 2, 3, 4)) for fn in (layer, comm, gemm))
    shard = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(),
                                             check_vma=False))
    received = [jax.jit(jax.shard_map(lambda x, i, w: jax_ep.dispatch(group, x, i, w)[0],
                                      mesh=mesh, in_specs=P(), out_specs=P(),
                                      check_vma=False))(*a) for a in ((x, idx, w), (x2, idx2, w2))]
    args = (x, x2, w, w2, params, received)
    return {name: (lambda fn=shard(fn): fn(*args))
            for name, fn in (("gemm", gemm), ("comm", comm), ("both", layer))}

  records = reports.Records(a.out)
  timelines = []
  # At one rank the SM budget bounds the kernels only on jax_ep's own stream.
  settings = [(stream, sms, kernel_sms) for stream in [None, *a.comm_streams]
              for sms in (a.num_sms if stream == OWN_STREAM else a.num_sms[:1])
              for kernel_sms in a.kernel_sms]
  for stream, num_sms, kernel_sms in settings:
    group = jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
                         dtype=dtype, comm_stream=stream, num_sms=num_sms)
    # The SMs of the partition jax_ep's own stream runs on (the process's first group made it).
    partition = (own_stream.prepare(ffi.extension(), jax.devices()[0].local_hardware_id,
                                    num_sms)
                 if stream == OWN_STREAM and group.backend_name == "cuda" else None)
    for pass_ in a.passes:
      times, streams, kernels = {}, {}, {}
      for name, prog in programs(group, pass_ == "forward_backward").items():
        run = lambda _, prog=prog: prog()
        with jax_ep.experts.override(kernel_sms=kernel_sms):  # traced on the first call
          jax.block_until_ready(run(0))
        if on_gpu:
          spans, ours, others, streams[name], kernels[name] = kernel_times(run, a.repeats)
          times[name] = (statistics.median(spans), statistics.median(ours),
                         statistics.median(others))
        else:  # the host clock, no kernels to tell apart: a check of the script itself
          times[name] = (timers._host_clock_median(run, a.repeats), None, None)
      (tg, _, g_alone), (tc, _, c_glue), (tb, _, other_both) = (
          times["gemm"], times["comm"], times["both"])
      # The GEMM side's kernels in `both`: the non-jax_ep kernels less the comm half's own
      # (its casts, slices and, in the backward, its loss), taken from `comm` alone.
      slowdown = (None if not g_alone
                  else round((other_both - c_glue) / g_alone, 3))
      ours_on, others_on = streams.get("both", (set(), set()))
      rec = reports.record(
          op="overlap", mode="high_throughput", backend=group.backend_name, ranks=1,
          tokens_per_rank=t, hidden=h, ffn=f, topk=k, experts=e, dtype="bfloat16",
          timing="device_trace" if on_gpu else "host_clock", comm_stream=stream,
          num_sms=num_sms, kernel_sms=kernel_sms, own_stream_partition_sms=partition,
          micro_batches=2, program="pipeline" if stream == OWN_STREAM else "halves",
          **{"pass": pass_},
          t_gemm_us=round(tg * 1e6, 1), t_comm_us=round(tc * 1e6, 1),
          t_both_us=round(tb * 1e6, 1), hidden_fraction=round((tg + tc - tb) / tc, 3),
          gemm_slowdown=slowdown, median_us=round(tb * 1e6, 1),
          comm_kernel_streams=sorted(ours_on), other_kernel_streams=sorted(others_on))
      records.append(rec)
      print(f"comm_stream={stream} num_sms={num_sms} kernel_sms={kernel_sms} "
            f"partition={partition} {pass_}: gemm {rec['t_gemm_us']} us, comm "
            f"{rec['t_comm_us']} us, both {rec['t_both_us']} us: hidden "
            f"{rec['hidden_fraction']:.2f}, GEMM kernels x{slowdown}; jax_ep kernels on "
            f"{sorted(ours_on)}, the others on {sorted(others_on)}", flush=True)
      for program in ("both", "gemm") if a.timeline else ():
        run_kernels, host = kernels.get(program, ([], []))
        if not run_kernels:
          continue
        listed, picture = timeline(run_kernels)
        if program == "both":
          print("\n".join(picture), flush=True)
        timelines.append(dict(comm_stream=stream, num_sms=num_sms, kernel_sms=kernel_sms,
                              **{"pass": pass_},
                              program=program, commit=rec.get("commit"), kernels=listed,
                              host=host_timeline(host, min(s for s, _, _, _ in run_kernels))))
    group.close()
  path = records.path
  print(f"wrote {path}")
  if a.timeline:
    with open(a.timeline, "w") as f:
      json.dump(timelines, f, indent=1)
    print(f"wrote {a.timeline} ({len(timelines)} timelines)")


if __name__ == "__main__":
  main()
