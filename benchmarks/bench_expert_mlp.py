"""The SwiGLU experts alone (`jax_ep.expert_mlp`) at the shapes of real models: TF/s against
three dense GEMMs of the same FLOPs in the same run, and what the worst-case capacity costs.

  python benchmarks/bench_expert_mlp.py                     # one GPU
  python benchmarks/bench_expert_mlp.py --impls fused       # the fused Hopper kernels alone
  python benchmarks/bench_expert_mlp.py --impls fused --multiples --tiles 128,64,64,4 64,128,64,4
                                                            # the fused kernels at other tiles
  python benchmarks/bench_expert_mlp.py --impls fused --multiples --tiles 128,64,64,4,4,2 \
      128,64,64,4,4      # the warp-specialized kernels at 4 stages; every kernel one warpgroup

Per shape (experts x hidden x ffn, top-k; one rank's rows at 4096 tokens, `rows = T * K`;
`deepseek_v3_ep8_rank` is one rank of DeepSeek-V3 at EP=8: 32 experts, ~1024 rows each):
- `op: expert_mlp`, `pass` fwd and fwd_bwd, per implementation (`fused`: the Hopper kernels of
  jax_ep/experts/mlp.py, the default there; `unfused`: three `grouped_matmul`s with the
  activation between them, `jax_ep.experts.override(fused_mlp=False)`), the groups skewed as a
  router makes them (a fixed Dirichlet draw, one expert empty);
- the exact buffer (`buffer_multiple` 1) and the same used rows at the front of buffers
  `--multiples` times larger, NaN past them (8: the default capacity at 8 ranks):
  `padded_ratio` = the time over the exact buffer's, same implementation, same run;
- FLOPs: `6 * rows * H * F` forward, three times that forward + backward; the bound: three
  dense GEMMs `[rows, H] x [H, F]` (twice) and `[rows, F] x [F, H]` of the same FLOPs in bf16,
  timed in the same run (`bound: dense_gemm`, `bound_tflops`; forward + backward: three times
  the forward's FLOPs at the same speed), `fraction = tflops / bound_tflops`.
`--tiles BM,BN,BK,STAGES[,BAND[,COMPUTE_WGS]] ...` times the fused kernels at each of those
tiles too (`jax_ep.experts.override(fused_tiles=...)`: every fused kernel one warpgroup at
those tiles; with two compute warpgroups `fused_gated_tiles=...` and
`fused_hidden_grad_tiles=...`: those kernels' warp-specialized forms, the default where F
holds 128 columns; records with `settings: {"tiles": ...}`).
`--breakdown N` prints each timed program's N longest kernels by device time per run (one
profiled trace after the timing; one process only), to tell which of the fused and the
unfused paths' kernels a difference comes from. A path that fails is printed and left out.
Records go to `benchmarks/results/expert_mlp.jsonl`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# The model shapes, the skewed groups and the timer are bench_layer's (importing it initializes
# a launched job).
from bench_layer import SHAPES, print_breakdown, skewed_sizes, time_fn  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import reports  # noqa: E402
import timers  # noqa: E402
import jax_ep  # noqa: E402
from jax_ep import experts  # noqa: E402
from jax_ep.experts import mlp  # noqa: E402

IMPLS = ("fused", "unfused")


def _padded(a, rows):
  """`a` at the front of `rows` rows, NaN past it (what a dispatch may leave there)."""
  return jnp.concatenate([a, jnp.full((rows - a.shape[0], a.shape[1]), jnp.nan, a.dtype)])


def programs():
  """`(forward, forward + backward)` of `jax_ep.expert_mlp`, new functions at each call. NOTES:
  jax caches a trace by function, not by `jax_ep.experts.override`'s context: each setting
  timed needs functions of its own, or it would time the first setting's program again."""
  def forward(x, w_gate, w_up, w_down, sizes):
    return jax_ep.expert_mlp(x, w_gate, w_up, w_down, sizes)

  def fwd_bwd(x, w_gate, w_up, w_down, sizes, dy):
    y, vjp = jax.vjp(lambda *a: forward(*a, sizes), x, w_gate, w_up, w_down)
    return y, vjp(dy)
  return jax.jit(forward), jax.jit(fwd_bwd)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
  parser.add_argument("--tokens", type=int, default=4096, help="tokens (rows = tokens * top-k)")
  parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
  parser.add_argument("--multiples", type=int, nargs="*", default=[2, 8],
                      help="padded buffers: this many times the used rows")
  parser.add_argument("--scale", type=int, default=1,
                      help="divide every size by this (a smoke run on the CPU)")
  parser.add_argument("--tiles", nargs="*", default=[],
                      help="fused kernels' tiles to time besides the default: "
                           "BM,BN,BK,STAGES[,BAND[,COMPUTE_WGS]] (COMPUTE_WGS 2: the gated "
                           "projections' and the hidden gradient's warp-specialized kernels)")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--breakdown", type=int, default=0, metavar="N",
                      help="print each program's N longest kernels (device time per run)")
  parser.add_argument("--out", default="expert_mlp.jsonl")
  args = parser.parse_args()

  dtype = jnp.bfloat16
  records = reports.Records(args.out)
  base = dict(mode="high_throughput", ranks=1, process_model="single_device", dtype="bfloat16",
              precision="bf16", activation="swiglu", groups="skewed")
  for name in args.shapes:
    num_experts, hidden, ffn, topk = (v // args.scale if i < 3 else v
                                      for i, v in enumerate(SHAPES[name]))
    num_experts = max(num_experts, topk)
    tokens = max(args.tokens // args.scale, 1)
    rows = tokens * topk
    keys = jax.random.split(jax.random.key(0), 5)
    normal = lambda k, shape, scale: (  # noqa: E731
        jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)
    x = normal(keys[0], (rows, hidden), 1.0)
    w_gate = normal(keys[1], (num_experts, hidden, ffn), hidden ** -0.5)
    w_up = normal(keys[2], (num_experts, hidden, ffn), hidden ** -0.5)
    w_down = normal(keys[3], (num_experts, ffn, hidden), ffn ** -0.5)
    dy = normal(keys[4], (rows, hidden), 1.0)
    sizes = skewed_sizes(rows, num_experts)
    flops = 6.0 * rows * hidden * ffn

    def dense(x, wg, wu, wd):
      def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype)
      return dot(x, wu), dot(dot(x, wg), wd)
    bound_s = time_fn(jax.jit(dense), (x, w_gate[0], w_up[0], w_down[0]), args.repeats,
                      f"{name} bound")
    if bound_s is None:
      continue
    runs = [(impl, None) for impl in args.impls]
    runs += [("fused", tiles) for tiles in args.tiles if "fused" in args.impls]
    for impl, tiles in runs:
      settings = "default"
      chosen = (experts.override(fused_mlp=False) if impl == "unfused"
                else contextlib.nullcontext())
      if tiles is not None:
        kernel_tiles = experts.KernelTiles(*(int(v) for v in tiles.split(",")))
        # Two compute warpgroups: the fused kernels that have a warp-specialized form (the
        # gated projections, the hidden gradient); the input gradient keeps its tiles.
        chosen = experts.override(
            **(dict(fused_gated_tiles=kernel_tiles, fused_hidden_grad_tiles=kernel_tiles)
               if kernel_tiles.compute_wgs > 1 else dict(fused_tiles=kernel_tiles)))
        settings = {"tiles": tiles}
      exact = {}
      with chosen:
        if impl == "fused":
          fused, why = mlp.fused_mlp_impl(rows, num_experts, hidden, ffn, dtype, "swiglu")
          if not fused:
            print(f"{name}: no fused run{' at ' + tiles if tiles else ''} ({why})")
            continue
        forward, fwd_bwd = programs()
        for multiple in [1, *(m for m in args.multiples if m > 1)]:
          buffer_rows = multiple * rows
          # What expert_mlp takes at this buffer's size (the choice is per shape).
          fused_here, why_here = mlp.fused_mlp_impl(buffer_rows, num_experts, hidden, ffn, dtype,
                                                    "swiglu")
          if impl == "fused" and not fused_here:
            print(f"{name} expert_mlp fused x{multiple}: failed: the fused kernels do not run "
                  f"at {buffer_rows} rows ({why_here})")
            continue
          xp, dyp = (_padded(x, buffer_rows), _padded(dy, buffer_rows)) if multiple > 1 else (
              x, dy)
          for pass_, fn, fn_args, f in (
              ("fwd", forward, (xp, w_gate, w_up, w_down, sizes), flops),
              ("fwd_bwd", fwd_bwd, (xp, w_gate, w_up, w_down, sizes, dyp),
               3 * flops)):
            what = f"{name} expert_mlp {pass_} {impl} {tiles or ''} x{multiple}"
            seconds = time_fn(fn, fn_args, args.repeats, what)
            if seconds is None:
              continue
            if args.breakdown and jax.process_count() == 1:
              print_breakdown(what, seconds, *timers.trace_breakdown(fn, fn_args),
                              args.breakdown)
            extra = {}
            if multiple == 1:
              exact[pass_] = seconds
            elif pass_ in exact:
              extra["padded_ratio"] = round(seconds / exact[pass_], 3)
            tflops = f / seconds / 1e12
            bound_tflops = flops / bound_s / 1e12
            records.append(reports.record(
                op="expert_mlp", **{"pass": pass_}, shape=name, impl=impl, experts=num_experts,
                hidden=hidden, ffn=ffn, topk=topk, tokens_per_rank=tokens, rows=rows,
                buffer_rows=buffer_rows, buffer_multiple=multiple, fused=bool(fused_here),
                median_us=round(seconds * 1e6, 1), tflops=round(tflops, 1), bound="dense_gemm",
                bound_tflops=round(bound_tflops, 1), fraction=round(tflops / bound_tflops, 3),
                settings=settings, **extra, **base))

  if jax.process_index() == 0:
    path = records.path
    reports.print_table(records, ["op", "pass", "shape", "impl", "settings", "buffer_multiple",
                                  "median_us", "tflops", "bound_tflops", "fraction",
                                  "padded_ratio"])
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
