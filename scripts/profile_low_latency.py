"""One decode-sized low-latency round trip at one rank, for a profiler (ncu, nsys).

Runs `--warmup` untimed rounds, then `--runs` rounds of low_latency_dispatch -> identity expert
-> low_latency_combine (the benchmark's shape by default: T=128, H=7168, top-8 of 256 experts,
fp8 dispatch), with `--profiler-range` bracketing only those in cudaProfilerStart / Stop so that
`ncu --profile-from-start off` sees the op's kernels alone:

  ncu --profile-from-start off -k regex:"Dispatch|Combine" --set detailed \
      python scripts/profile_low_latency.py --profiler-range
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
import reports  # noqa: E402 - benchmarks/reports.py


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=128)
  parser.add_argument("--hidden", type=int, default=7168)
  parser.add_argument("--experts", type=int, default=256)
  parser.add_argument("--topk", type=int, default=8)
  parser.add_argument("--format", choices=["fp8", "bf16"], default="fp8")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--runs", type=int, default=1)
  parser.add_argument("--profiler-range", action="store_true")
  args = parser.parse_args()
  t, h, e, k = args.tokens, args.hidden, args.experts, args.topk
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  group = jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
                       dtype=jnp.bfloat16, backend="cuda", low_latency=True)
  rng = np.random.default_rng(0)
  sharded = NamedSharding(mesh, P("ep"))
  put = lambda a, dtype: jax.device_put(jnp.asarray(a, dtype), sharded)
  x = put(rng.standard_normal((1, t, h)), jnp.bfloat16)
  idx = put(reports.uniform_topk(rng, t, e, k)[None], jnp.int32)
  w = put(rng.random((1, t, k)) / k, jnp.float32)
  fixed = put(np.full((1, e, group.config.low_latency_slab, h), 0.01), jnp.bfloat16)

  def body(x, idx, w, fixed):
    recv, handle = jax_ep.low_latency_dispatch(
        group, x[0], idx[0], row_format=jax_ep.RowFormat.FP8 if args.format == "fp8" else None)
    eo = recv.x if args.format == "bf16" else fixed[0]
    return jax_ep.low_latency_combine(group, eo, handle, w[0])[None]
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  for _ in range(args.warmup):
    jax.block_until_ready(step(x, idx, w, fixed))
  if args.profiler_range:
    from cupy.cuda import profiler  # noqa: PLC0415 - only on the GPU machine
    profiler.start()
  for _ in range(args.runs):
    jax.block_until_ready(step(x, idx, w, fixed))
  if args.profiler_range:
    profiler.stop()
  print("done", flush=True)


if __name__ == "__main__":
  main()
