"""jax_ep's FP8 grouped GEMM (jax_ep/experts/hopper_fp8.py) against the bf16 grouped GEMM and
dense GEMMs of the same FLOPs, at the shapes of real models, in one run (a Hopper GPU).

  python benchmarks/bench_fp8_gemm.py                   # the five model shapes, up and down
  python benchmarks/bench_fp8_gemm.py --tune            # also the FP8 kernel at other tiles
  python benchmarks/bench_fp8_gemm.py --shapes mixtral --tiles 128,64,4,4,2 64,128,4,4,1
  python benchmarks/bench_fp8_gemm.py --shapes qwen3_30b_a3b --scale 16 --tokens 16 \\
      --interpret --repeats 0                         # a smoke run of the records on the CPU

Per shape (experts x hidden x ffn, top-k; one rank's rows at 4096 tokens, `rows = T * K`, the
groups skewed as a router makes them: a fixed Dirichlet draw, one expert empty) and product
(`up`: `[rows, H] x [H, F]`, the gate / up projections; `down`: `[rows, F] x [F, H]`; the FP8
MLP's own kernels, `--products gate_up input_grad`: `gate_up` the gated kernel, both
projections of `[rows, H]` with SwiGLU and `h`'s quantisation in its epilogue, against the bf16
`[rows, H] x [H, 2F]`; `input_grad` `dgate @ w_gate^T + dup @ w_up^T` as the MLP runs it, the
FP8 product over `[dgate | dup]` (K = 2F), against the bf16 `[rows, 2F] x [2F, H]`; their
FLOPs are both products'; `weight_grad`: the weight gradient `x^T dy` per expert, `[rows, H]`
e4m3 rows with their scales and `[rows, F]` bf16 cotangents (as the MLP's `x` and `[dgate |
dup]`) -> `[G, H, F]`, the FP8 kernel with both operands' quantisation per 128 tokens per
channel into its copies timed in (the kernel alone: `settings: {"without": "column
quantisation"}`), against jax_ep's bf16 weight gradient of the bf16 rows, the dense bound `x^T
@ dy`):
- `op: grouped_matmul`, `pass: fwd`, `precision: fp8`: the FP8 kernel on e4m3 rows with
  per-128-channel scales and e4m3 weights with 128x128-block scales (quantised before the
  timing: the kernel alone), bf16 out, the tiles `configs.fp8_tile_config` picks;
- `precision: bf16`: `jax_ep.grouped_matmul` of the same shape in bf16 (its own choice of
  implementation, `impl` in the record); the FP8 record's `speedup_vs_bf16` is its time over
  the FP8 kernel's, same run;
- the bounds, timed in the same run: a dense `jnp.dot` `[rows, K] x [K, N]` in bf16
  (`bound: dense_gemm`, `bound_tflops`, `fraction = tflops / bound_tflops`, as every
  grouped_matmul record) and of e4m3 operands with bf16 out (`dense_fp8_tflops`: what XLA's
  own FP8 GEMM reaches, unscaled).
FLOPs: `2 * rows * K * N`. Device-clock timing (bench_layer's `time_fn`; `--repeats 0` runs
each product once: the records of a smoke run, no timing). `--tiles BM,BN,STAGES,
BAND,WGS ...` (and `--tune`'s fixed set) times the FP8 kernel at those tiles too (`settings:
{"tiles": ...}`); tiles that do not build are printed and left out. Records go to
`benchmarks/results/grouped_matmul_fp8.jsonl`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# The model shapes, the skewed groups and the timer are bench_layer's.
from bench_layer import SHAPES, skewed_sizes, time_fn  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import reports  # noqa: E402
import jax_ep  # noqa: E402
from jax_ep._native.fp8 import fp8_quantize  # noqa: E402
from jax_ep.experts import configs, hopper_fp8, hopper_fp8_wgrad  # noqa: E402
from jax_ep.experts.configs import KernelTiles  # noqa: E402

# `--tune`'s candidates (BM, BN, STAGES, BAND, WGS; block_k is the scales' 128).
TUNE = ("128,128,3,4,2", "128,128,5,4,2", "128,128,4,1,2", "128,128,4,8,2", "128,64,4,4,2",
        "256,64,4,4,2", "64,128,4,4,1", "64,128,6,4,1")


# product -> (K and N as the hidden / ffn sizes, how many products the kernel runs): `gate_up`
# multiplies one row operand by two weights, `input_grad` two row operands by two weights (one
# product over both, K = 2F).
PRODUCTS = {"up": ("hidden", "ffn", 1), "down": ("ffn", "hidden", 1),
            "gate_up": ("hidden", "ffn", 2), "input_grad": ("ffn", "hidden", 2),
            "weight_grad": ("hidden", "ffn", 1)}


def quantize_weights(w):
  """`[G, N, K]` -> e4m3 and `[G, N/128, K/128]` f32 scales: amax / 448 per 128x128 block."""
  g, n, k = w.shape
  blocks = w.astype(jnp.float32).reshape(g, n // 128, 128, k // 128, 128)
  amax = jnp.max(jnp.abs(blocks), axis=(2, 4))
  scales = jnp.where(amax > 0, amax / 448.0, 1.0)
  q = (blocks / scales[:, :, None, :, None]).astype(jnp.float8_e4m3fn)
  return q.reshape(g, n, k), scales


def fp8_kernel(product: str, groups: int, k: int, n: int):
  """The FP8 kernel a product runs and its default tiles: `(tiles, fn(*operands, tiles))`, the
  operands each row operand's values and scales, each weight's, then the group sizes."""
  if product == "gate_up":
    def gated(x, xs, w_gate, s_gate, w_up, s_up, sizes, tiles):
      return hopper_fp8.fp8_gated_kernel(x, xs, w_gate, w_up, s_gate, s_up, sizes,
                                         activation="swiglu", tiles=tiles)
    return configs.fp8_gated_tiles(k, n), gated

  def matmul(x, xs, w, ws, sizes, tiles):
    return hopper_fp8.fp8_grouped_matmul_kernel(x, xs, w, ws, sizes, tiles=tiles)
  if product == "input_grad":  # [dgate | dup] x [w_gate | w_up]: K = 2F
    return configs.fp8_tile_config(groups, 2 * k, n), matmul
  return configs.fp8_tile_config(groups, k, n), matmul


def dense_bounds(dot, operands, repeats: int, what: str):
  """`(bf16 seconds, e4m3 seconds)` of the dense `dot` on the bf16 `operands` and on their
  e4m3 casts (XLA's own FP8 GEMM, unscaled); None where one failed."""
  bound_s = time_fn(jax.jit(dot), operands, repeats, f"{what} dense bf16")
  dense8_s = time_fn(jax.jit(dot), tuple(a.astype(jnp.float8_e4m3fn) for a in operands),
                     repeats, f"{what} dense e4m3")
  return bound_s, dense8_s


def recorder(records, flops: float, bound_tflops: float, shape: dict, base: dict):
  """`record(precision, impl, seconds, settings="default", **extra)`: one product's record."""
  def record(precision, impl, seconds, settings="default", **extra):
    tflops = flops / seconds / 1e12
    records.append(reports.record(
        op="grouped_matmul", **{"pass": "fwd"}, precision=precision, impl=impl,
        dtype="float8_e4m3fn" if precision == "fp8" else "bfloat16",
        median_us=round(seconds * 1e6, 1), tflops=round(tflops, 1), bound="dense_gemm",
        bound_tflops=round(bound_tflops, 1), fraction=round(tflops / bound_tflops, 3),
        settings=settings, **extra, **shape, **base))
  return record


def against(seconds: float, flops: float, bf16_s, dense8_s) -> dict:
  """An FP8 record's comparisons: its speed over the bf16 product's, the dense FP8 GEMM's."""
  extra = {}
  if bf16_s is not None:
    extra["speedup_vs_bf16"] = round(bf16_s / seconds, 3)
  if dense8_s is not None:
    extra["dense_fp8_tflops"] = round(flops / dense8_s / 1e12, 1)
  return extra


def bench_weight_grad(records, name, num_experts, hidden, ffn, topk, rows, sizes, args,
                      interpreted, base):
  """The `weight_grad` product's records (the module docstring)."""
  from jax_ep.experts.grouped import weight_grad_fn
  from jax_ep.experts.layout import aligned_blocks, contiguous_offsets
  from jax_ep.experts.quantize_kernel import quantize_column_blocks
  keys = jax.random.split(jax.random.key(1), 2)
  x = jax.random.normal(keys[0], (rows, hidden), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[1], (rows, ffn), jnp.float32).astype(jnp.bfloat16)
  xq, xs = jax.jit(fp8_quantize)(x)
  offsets = contiguous_offsets(sizes)
  flops = 2.0 * rows * hidden * ffn
  what = f"{name} weight_grad"
  shape = dict(shape=name, product="weight_grad", experts=num_experts, hidden=hidden, ffn=ffn,
               topk=topk, tokens_per_rank=args.tokens, rows=rows, k=hidden, n=ffn)

  def dot_t(a, b):  # a^T b: the dense weight gradient
    return jnp.dot(a.T, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  bound_s, dense8_s = dense_bounds(dot_t, (x, dy), args.repeats, what)
  if bound_s is None:
    return
  record = recorder(records, flops, flops / bound_s / 1e12, shape, base)

  bf16_s = time_fn(jax.jit(weight_grad_fn(False, jnp.dtype(jnp.bfloat16), "auto")),
                   (x, dy, sizes, offsets), args.repeats, f"{what} bf16")
  if bf16_s is not None:
    impl, _ = jax_ep.grouped_matmul_impl(rows, num_experts, hidden, ffn, jnp.bfloat16)
    record("bf16", impl, bf16_s)
  tiles = configs.fp8_weight_grad_tiles(hidden, ffn)
  columns = functools.partial(quantize_column_blocks, interpret=args.interpret)

  def copies(xq, xs, dy, sizes, offsets):
    src, count, first, blocks = aligned_blocks(sizes, offsets, rows, 128)
    return (*columns(xq, xs, src, count), *columns(dy, None, src, count), first, blocks)

  def kernel(*operands):
    return hopper_fp8_wgrad.fp8_weight_grad_kernel(*operands, tiles=tiles)[0]
  with interpreted():
    whole_s = time_fn(jax.jit(lambda *a: kernel(*copies(*a))), (xq, xs, dy, sizes, offsets),
                      args.repeats, f"{what} fp8 with its copies")
    prepared = jax.jit(copies)(xq, xs, dy, sizes, offsets)
    alone_s = time_fn(jax.jit(kernel), prepared, args.repeats, f"{what} fp8 kernel")
  for seconds, settings in ((whole_s, "default"),
                            (alone_s, {"without": "column quantisation"})):
    if seconds is not None:
      record("fp8", "mosaic_fp8", seconds, settings,
             **against(seconds, flops, bf16_s, dense8_s))


def parse_tiles(text: str) -> KernelTiles:
  bm, bn, stages, band, wgs = (int(v) for v in text.split(","))
  return KernelTiles(bm, bn, hopper_fp8.SCALE_BLOCK, stages, band, wgs)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
  parser.add_argument("--products", nargs="+", choices=list(PRODUCTS), default=["up", "down"])
  parser.add_argument("--tokens", type=int, default=4096, help="tokens (rows = tokens * top-k)")
  parser.add_argument("--tiles", nargs="*", default=[],
                      help="FP8 kernel tiles to time besides the default: BM,BN,STAGES,BAND,WGS")
  parser.add_argument("--tune", action="store_true", help="time the FP8 kernel at --tiles "
                      "and a fixed set of candidates")
  parser.add_argument("--scale", type=int, default=1, help="divide the experts, hidden and "
                      "ffn by this (hidden and ffn rounded up to multiples of 128): a smoke run")
  parser.add_argument("--interpret", action="store_true", help="run the FP8 kernel in "
                      "Pallas's Mosaic GPU interpreter (a smoke run on the CPU; no timing)")
  parser.add_argument("--repeats", type=int, default=10,
                      help="timed runs of each product after a warm-up (0: one run, no timing)")
  parser.add_argument("--out", default="grouped_matmul_fp8.jsonl")
  args = parser.parse_args()
  candidates = list(args.tiles) + (list(TUNE) if args.tune else [])

  def interpreted():
    if not args.interpret:
      return contextlib.nullcontext()
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.force_gpu_interpret_mode()

  records = reports.Records(args.out)
  base = dict(mode="high_throughput", ranks=1, process_model="single_device", groups="skewed")
  for name in args.shapes:
    num_experts, hidden, ffn, topk = SHAPES[name]
    if args.scale > 1:
      up = lambda v: -(-(v // args.scale) // 128) * 128  # noqa: E731
      num_experts, hidden, ffn = max(num_experts // args.scale, 1), up(hidden), up(ffn)
    rows = args.tokens * topk
    sizes = skewed_sizes(rows, num_experts)
    for product in args.products:
      if product == "weight_grad":
        bench_weight_grad(records, name, num_experts, hidden, ffn, topk, rows, sizes, args,
                          interpreted, base)
        continue
      k_name, n_name, parts = PRODUCTS[product]
      k, n = (dict(hidden=hidden, ffn=ffn)[d] for d in (k_name, n_name))
      keys = jax.random.split(jax.random.key(0), 2)
      # The bf16 product of the same FLOPs: the two projections' weights side by side
      # (gate_up: [G, K, 2N]), or both row operands and weights along K (input_grad).
      k_all, n_all = (k * parts, n) if product == "input_grad" else (k, n * parts)
      x = jax.random.normal(keys[0], (rows, k_all), jnp.float32).astype(jnp.bfloat16)
      w = (jax.random.normal(keys[1], (num_experts, k_all, n_all), jnp.float32)
           * k_all ** -0.5).astype(jnp.bfloat16)
      if product == "input_grad":  # one operand over both projections' rows and weights
        xqs = [jax.jit(fp8_quantize)(x)]
        wqs = [jax.jit(quantize_weights)(jnp.swapaxes(w, 1, 2))]
      else:
        xqs = [jax.jit(fp8_quantize)(x)]
        wqs = [jax.jit(quantize_weights)(jnp.swapaxes(w[:, :, i * n:(i + 1) * n], 1, 2))
               for i in range(parts)]  # K-major: [G, N, K]
      flops = 2.0 * rows * k * n * parts
      shape = dict(shape=name, product=product, experts=num_experts, hidden=hidden, ffn=ffn,
                   topk=topk, tokens_per_rank=args.tokens, rows=rows, k=k, n=n)

      def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
      bound_s, dense8_s = dense_bounds(dot, (x, w[0]), args.repeats, f"{name} {product}")
      if bound_s is None:
        continue
      record = recorder(records, flops, flops / bound_s / 1e12, shape, base)

      impl, _ = jax_ep.grouped_matmul_impl(rows, num_experts, k_all, n_all, jnp.bfloat16)
      bf16_s = time_fn(jax.jit(jax_ep.grouped_matmul), (x, w, sizes), args.repeats,
                       f"{name} {product} bf16 grouped_matmul")
      if bf16_s is not None:
        record("bf16", impl, bf16_s)
      del w
      default, kernel = fp8_kernel(product, num_experts, k, n)
      operands = (*(a for q in xqs for a in q), *(a for q in wqs for a in q), sizes)
      # Other tiles are the grouped GEMM kernel's (up, down and the input gradient).
      others = [parse_tiles(t) for t in candidates] if product != "gate_up" else []
      for tiles in [default, *others]:
        fn = jax.jit(functools.partial(kernel, tiles=tiles))
        # Tiles the kernel refuses fail inside (named there, printed) and are left out.
        with interpreted():
          seconds = time_fn(fn, operands, args.repeats, f"{name} {product} fp8 {tiles}")
        if seconds is None:
          continue
        settings = "default" if tiles is default else {"tiles": [
            tiles.block_m, tiles.block_n, tiles.stages, tiles.band, tiles.compute_wgs]}
        record("fp8", "mosaic_fp8", seconds, settings,
               **against(seconds, flops, bf16_s, dense8_s))

  if jax.process_index() == 0:
    path = records.path
    reports.print_table(records, ["shape", "product", "precision", "impl", "settings",
                                  "median_us", "tflops", "bound_tflops", "fraction",
                                  "speedup_vs_bf16", "dense_fp8_tflops"])
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
