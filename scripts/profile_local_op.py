"""Runs one one-rank op a few times at the benchmark shape, for a kernel profiler (ncu).

  ncu -k regex:Unpermute python3 scripts/profile_local_op.py --op combine --backend cuda

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

import common  # noqa: E402
import jax_ep  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--op", choices=["dispatch", "combine"], default="combine")
  parser.add_argument("--backend", choices=["cuda", "reference"], default="cuda")
  parser.add_argument("--tokens", type=int, default=128)
  parser.add_argument("--runs", type=int, default=4)
  args = parser.parse_args()
  t, h, k, e = args.tokens, 7168, 8, 256
  rng = np.random.default_rng(0)
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  group = jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
                       dtype=jnp.bfloat16, backend=args.backend)
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  idx = jnp.asarray(common.uniform_topk(rng, t, e, k))
  w = jnp.asarray(rng.random((t, k)), jnp.float32)
  eo = jnp.asarray(rng.standard_normal((group.capacity, h)), jnp.bfloat16)
  per_shard = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(),
                                               check_vma=False))
  dispatch = per_shard(lambda x, i, w: jax_ep.dispatch(group, x, i, w))
  combine = per_shard(lambda eo, h: jax_ep.combine(group, eo, h))
  handle = None
  if args.op == "combine":  # (a profiler filtering on dispatch kernels sees `runs` of them)
    _, handle = dispatch(x, idx, w)
  for _ in range(args.runs):
    out = dispatch(x, idx, w) if args.op == "dispatch" else combine(eo, handle)
    jax.block_until_ready(out)
  print(f"ran {args.op} on {args.backend} {args.runs} times")


if __name__ == "__main__":
  main()
