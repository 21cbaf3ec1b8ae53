"""The decode layer's experts on the low-latency slabs: the kernels that stop at each expert's
count (`jax_ep.expert_mlp_slabs`, impl 'pallas') against the batched matmul over whole slabs
(impl 'dense'), side by side in one run.

  python benchmarks/bench_slab_mlp.py

Per model shape (experts x hidden x ffn, top-k) and emulated rank count R, one rank's slabs as
the low-latency dispatch leaves them at T tokens per rank: `L = E / R` experts, `S = R * T`
rows per slab, counts from uniform top-k routing of the `R * T` tokens of the group. Records:
`mode: "low_latency"`, `op: "expert_mlp_slabs"`, `impl`, `rows` (the routed rows, sum of the
counts), `slab_rows` (`L * S`), `median_us` (median device span of one jitted call on a GPU, host clock elsewhere), `tflops`
on the routed rows' FLOPs (`6 * rows * H * F`), and `weight_gbps` (the experts' weights read
once per call) — decode is bound by the weights. Records go to
`benchmarks/results/slab_mlp.jsonl`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import reports  # noqa: E402
import timers  # noqa: E402
import jax_ep  # noqa: E402
from jax_ep import experts  # noqa: E402
from jax_ep.experts import slab as slab_mlp  # noqa: E402

# name: (experts, hidden, ffn, top-k)
SHAPES = {
    "deepseek_v3": (256, 7168, 2048, 8),
    "qwen3_30b_a3b": (128, 2048, 768, 8),
}


def slab_counts(rng, ranks: int, tokens: int, experts: int, topk: int) -> np.ndarray:
  """Rank 0's per-expert rows when every rank routes `tokens` tokens uniformly."""
  idx = reports.uniform_topk(rng, ranks * tokens, experts, topk)
  counts = np.bincount(idx.reshape(-1), minlength=experts)
  return counts[: experts // ranks].astype(np.int32)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
  parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--tokens", type=int, default=128)
  parser.add_argument("--impls", nargs="+", default=["pallas", "dense"])
  parser.add_argument("--repeats", type=int, default=9)
  parser.add_argument("--scale", type=int, default=1,
                      help="divide experts, hidden and ffn by this (hidden and ffn kept "
                           "multiples of 128): small runs, e.g. on the CPU with --impls "
                           "interpret dense")
  parser.add_argument("--tiles", nargs="+", default=None,
                      help="tile settings of the kernels to compare, each BM,BN,BK,WARPS,STAGES "
                           "(default: the module's rule); each is checked against the dense "
                           "formulation on the bench's slabs before it is timed")
  parser.add_argument("--out", default="slab_mlp.jsonl")
  args = parser.parse_args()
  records = []
  for shape in args.shapes:
    e, h, f, k = SHAPES[shape]
    if args.scale > 1:
      e = max(max(args.ranks), e // args.scale)
      h, f = (max(128, d // args.scale // 128 * 128) for d in (h, f))
    for r in args.ranks:
      num_local, slab = e // r, r * args.tokens
      rng = np.random.default_rng(0)
      count = jnp.asarray(slab_counts(rng, r, args.tokens, e, k))
      # Random values (drawn on the device), so that the check of a tile setting against the
      # dense formulation would see rows or experts mixed up.
      keys = jax.random.split(jax.random.key(0), 4)
      normal = lambda key, shape, s: (s * jax.random.normal(key, shape)).astype(jnp.bfloat16)
      rows = normal(keys[0], (num_local, slab, h), 1.0)
      w_gate = normal(keys[1], (num_local, h, f), 0.02)
      w_up = normal(keys[2], (num_local, h, f), 0.02)
      w_down = normal(keys[3], (num_local, f, h), 0.02)
      routed = int(count.sum())
      inputs = (rows, w_gate, w_up, w_down, count)
      runs = [(impl, None) for impl in args.impls if impl not in ("pallas", "interpret")
              or not args.tiles]
      runs += [(impl, t) for impl in args.impls if impl in ("pallas", "interpret")
               for t in (args.tiles or [])]
      want = None
      for impl, tiles in runs:
        settings = "default"
        chosen = contextlib.nullcontext()
        if tiles is not None:
          chosen = experts.override(slab_tiles=experts.SlabTiles(
              *(int(v) for v in tiles.split(","))))
          settings = {"tiles": tiles}
        fn = jax.jit(lambda *a, impl=impl: jax_ep.expert_mlp_slabs(*a, impl=impl))
        try:
          chosen.__enter__()
          if tiles is not None:  # a tile setting is timed only once it computes the right rows
            if want is None:
              want = np.asarray(slab_mlp.dense_mlp(*inputs), np.float32)
            got = np.asarray(fn(*inputs), np.float32)
            used = np.arange(slab)[None, :, None] < np.asarray(count)[:, None, None]
            err = float(np.abs(np.where(used, got - want, 0.0)).max())
            if not err <= 0.02 * float(np.abs(want).max()) + 1e-6:
              print(f"{shape} R={r} {impl} tiles {tiles}: wrong rows (max error {err})")
              continue
          seconds, method = timers.time_batches(fn, inputs, repeats=args.repeats)
        except Exception as err:  # noqa: BLE001 - a path that fails is reported, not fatal
          print(f"{shape} R={r} {impl} {tiles or ''}: failed: {type(err).__name__}: {err}"[:400])
          continue
        finally:
          chosen.__exit__(None, None, None)
        us = seconds * 1e6
        weights = 3 * num_local * h * f * 2
        records.append(reports.record(
            mode="low_latency", op="expert_mlp_slabs", shape=shape, impl=impl, ranks=r,
            tokens_per_rank=args.tokens, experts=e, hidden=h, ffn=f, topk=k,
            experts_per_rank=num_local, slab=slab, rows=routed, slab_rows=num_local * slab,
            dtype="bfloat16", timing=method, median_us=round(us, 1),
            tflops=round(6 * routed * h * f / (us * 1e-6) / 1e12, 2),
            weight_gbps=round(weights / (us * 1e-6) / 1e9, 1), settings=settings))
        print(f"{shape} R={r} {impl} {tiles or ''}: {us:.1f} us ({routed} rows of "
              f"{num_local * slab})", flush=True)
      del rows, w_gate, w_up, w_down
  path = reports.write_jsonl(records, args.out)
  reports.print_table(records, ["shape", "ranks", "impl", "settings", "rows", "slab_rows",
                                "median_us", "tflops", "weight_gbps"])
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
