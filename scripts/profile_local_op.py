"""Runs one one-rank op a few times at the benchmark shape, for a kernel profiler (ncu).

  ncu -k regex:Combine python3 scripts/profile_local_op.py --op combine --backend cuda

The shape and kind of inputs of benchmarks/bench_local.py (bf16, H=7168, top-8 of 256 experts,
uniform routing; not its exact draws); one jitted call per run, so the profiler sees each kernel
once per run.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reports  # noqa: E402
import timers  # noqa: E402
import jax_ep  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--op", choices=["dispatch", "combine"], default="combine")
  parser.add_argument("--backend", choices=["cuda", "reference"], default="cuda")
  parser.add_argument("--tokens", type=int, default=128)
  parser.add_argument("--runs", type=int, default=4)
  parser.add_argument("--profiler-range", action="store_true",
                      help="bracket the runs with cudaProfilerStart/Stop (through cupy), for "
                      "`ncu --profile-from-start off`: the profiler sees the op's kernels only, "
                      "not the input conversions or the dispatch that makes the handle")
  parser.add_argument("--trace", action="store_true",
                      help="run under jax.profiler instead and print every GPU stream event of "
                      "each run (name, start offset and duration in us): what a benchmark's "
                      "device span of one run is made of")
  args = parser.parse_args()
  t, h, k, e = args.tokens, 7168, 8, 256
  rng = np.random.default_rng(0)
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  group = jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
                       dtype=jnp.bfloat16, backend=args.backend)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  idx = jnp.asarray(reports.uniform_topk(rng, t, e, k))
  w = jnp.asarray(rng.random((t, k)), jnp.float32)
  eo = jnp.asarray(rng.standard_normal((group.capacity, h)), jnp.bfloat16)
  per_shard = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(),
                                               check_vma=False))
  dispatch = per_shard(lambda x, i, w: jax_ep.dispatch(group, x, i, w))
  combine = per_shard(lambda eo, h: jax_ep.combine(group, eo, h))
  handle = None
  if args.op == "combine":  # (a profiler filtering on dispatch kernels sees one more of them)
    _, handle = dispatch(x, idx, w)
  run = lambda _: dispatch(x, idx, w) if args.op == "dispatch" else combine(eo, handle)
  # One warm-up: compiled (and its one-time kernels run) before any trace or profiler range.
  jax.block_until_ready(run(0))
  if args.trace:
    events = sorted(timers._traced_events(run, args.runs), key=lambda e: e[1])
    spans = timers.split_runs([(start, end) for _, start, end in events], args.runs)
    print(f"{args.op} {args.backend} T={t}: run spans (us):",
          " ".join(f"{s * 1e6:.2f}" for s in spans))
    origin = events[0][1] if events else 0
    for name, start, end in events:
      print(f"  +{(start - origin) / 1e3:10.2f} us  {(end - start) / 1e3:8.2f} us  {name[:90]}")
    return
  if args.profiler_range:
    from cupy.cuda import profiler  # noqa: PLC0415 - only on the GPU machine
    profiler.start()
  for r in range(args.runs):
    jax.block_until_ready(run(r))
  if args.profiler_range:
    profiler.stop()
  print(f"ran {args.op} on {args.backend} {args.runs} times")


if __name__ == "__main__":
  main()
