"""One MoE layer with its experts, and its grouped matmul, at the shapes of real models:
TF/s of jax_ep's Mosaic GPU kernels (and of jax's, and `lax.ragged_dot`), against a dense GEMM
of the same FLOPs in the same run.

  python benchmarks/bench_layer.py                          # one GPU
  python -m jax_ep.launch -n 2 -- python benchmarks/bench_layer.py  # the layer at R = 2
  python benchmarks/bench_layer.py --tune                   # tiles for configs.TILE_TABLES

Per shape (experts x hidden x ffn, top-k; 4096 tokens per rank):
- `grouped_matmul`: one `jax_ep.grouped_matmul` `[rows, H] x [E, H, F]` over skewed groups (a
  fixed Dirichlet draw with one empty group, as a router makes them; `--groups balanced` for
  equal ones), forward (`2 * rows * H * F` FLOPs) and forward + backward (three times that),
  per implementation (`mosaic`: jax_ep's kernels; `jax_mosaic`: jax's
  `ragged_dot_mgpu`, for comparison; `xla`: `lax.ragged_dot`); and the padded case: the same
  used rows in a buffer 8 times larger (what the default capacity gives at 8 ranks),
  `padded_ratio` = its time over the exact buffer's;
- `moe_layer`: `jax_ep.moe_mlp` (its own router on random weights, so the groups are as the
  router makes them; dispatch, three grouped matmuls, combine), forward and
  forward + backward, per implementation of its grouped matmuls
  (`jax_ep.experts.override(impl=...)`) and per `--micro-batches` count (the layer's
  `micro_batches`, in the records, on a group sized for one micro-batch);
  its FLOPs are the three expert matmuls' (`6 * rows * H * F`, times three with the backward);
  with `--calls-per-step N`, N calls in one program, each on its own tokens, their time per
  call (`calls_per_step`), the FP8 weights quantised once for all of them (the recipe's once
  a step, as a step with gradient accumulation runs it);
- the bound: a dense `jnp.dot` `[rows, H] x [H, F]` of the same FLOPs in the same run
  (`bound: dense_gemm`, `bound_tflops`, `fraction = tflops / bound_tflops`); a batched
  `einsum('gmk,gkn->gmn')` of the same FLOPs is recorded beside it (`batched_tflops`).
A path that fails (e.g. out of memory: `lax.ragged_dot` expands densely on GPUs) is printed and
left out. Times: medians of device spans (GPU trace) or of the host clock. Records go to
`benchmarks/results/layer.jsonl`; `--plot FILE.png` draws TF/s per shape (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from jax_ep import launch  # noqa: E402

launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import reports  # noqa: E402
import timers  # noqa: E402
import jax_ep  # noqa: E402
import jax_ep.experts  # noqa: E402
from jax_ep.experts import hopper, hopper_wgrad, mlp, mlp_fp8  # noqa: E402

# name: (experts, hidden, ffn, top-k)
SHAPES = {
    "deepseek_v3": (256, 7168, 2048, 8),
    "qwen3_30b_a3b": (128, 2048, 768, 8),
    "e32_h4096_f1536": (32, 4096, 1536, 4),
    "mixtral": (8, 4096, 14336, 2),
    # One rank of DeepSeek-V3 at EP=8: its 32 experts, the rows of 4096 tokens' top-8.
    "deepseek_v3_ep8_rank": (32, 7168, 2048, 8),
}
SMEM_PER_SM = jax_ep.experts.configs.SMEM_PER_SM


def balanced_sizes(rows: int, groups: int):
  base = np.full(groups, rows // groups, np.int32)
  base[: rows % groups] += 1
  return jnp.asarray(base)


def skewed_sizes(rows: int, groups: int, seed: int = 0):
  """Group sizes summing to `rows`, drawn from a Dirichlet(0.5) (a few hot experts, many cold)
  with group 1 empty: fixed per (rows, groups), so every run times the same groups."""
  rng = np.random.default_rng([seed, rows, groups])
  p = rng.dirichlet(np.full(groups, 0.5))
  if groups > 1:
    p[1] = 0.0
    p /= p.sum()
  sizes = np.floor(p * rows).astype(np.int64)
  sizes[np.argmax(p)] += rows - sizes.sum()
  return jnp.asarray(sizes.astype(np.int32))


_TIMINGS = itertools.count()


def time_fn(fn, args, repeats, what):
  """Median seconds of `fn(*args)`, the slowest process's; None where it failed on any process
  (printed). Every process times the same calls in the same order, so the n-th timing of one
  is the n-th of every other, failures included. `repeats` 0: one call's host seconds, compile
  included (a smoke run's records, the least work: no timing)."""
  key = f"layer/{next(_TIMINGS)}"
  try:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    seconds = time.perf_counter() - start
    if repeats:
      seconds, _ = timers.time_batches(
          fn, args, repeats=repeats,
          method="auto" if jax.process_count() == 1 else "host_clock")
  except Exception as e:  # noqa: BLE001 - e.g. out of memory; the other paths run
    print(f"{what}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    seconds = math.inf
  seconds = reports.gather_max(key, seconds)
  return None if math.isinf(seconds) else seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
  parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
  parser.add_argument("--impls", nargs="+", choices=["mosaic", "jax_mosaic", "xla"],
                      default=["mosaic", "jax_mosaic", "xla"])
  parser.add_argument("--groups", choices=["skewed", "balanced"], default="skewed")
  parser.add_argument("--alignments", type=int, nargs="+", default=[1, 128],
                      help="expert alignments of the grouped_matmul op's layout (jax_ep's "
                      "kernels): 1 is contiguous groups; A > 1 starts each group at a multiple "
                      "of A, as a dispatch with Group(expert_alignment=A) lays them out")
  parser.add_argument("--pad", type=int, default=8,
                      help="the padded case's buffer: this many times the used rows (0: none)")
  parser.add_argument("--ops", nargs="+", choices=["grouped_matmul", "moe_layer"],
                      default=["grouped_matmul", "moe_layer"])
  parser.add_argument("--micro-batches", type=int, nargs="+", default=[1],
                      help="moe_layer: time the layer with each of these micro_batches")
  parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp8"], default=["bf16"],
                      help="moe_layer: the experts in bf16 and/or FP8 (moe_mlp's fp8=True), "
                           "each a record with its `precision`")
  parser.add_argument("--fp8-wire", action="store_true",
                      help="moe_layer with fp8: the dispatch sends e4m3 rows "
                           "(wire_format=RowFormat.FP8) instead of the experts quantising them")
  parser.add_argument("--fp8-weight-grads", nargs="+", choices=["bf16", "fp8"],
                      default=["fp8"],
                      help="moe_layer with fp8: the weight gradients in FP8 (the default), in "
                           "bf16 (experts.override(fp8_weight_grad=False)), or both in one run "
                           "(`weight_grad` in the records)")
  parser.add_argument("--calls-per-step", type=int, default=1, metavar="N",
                      help="moe_layer: N calls in one program, time per call; with fp8 the "
                           "weights quantised once for the N (per step, not per call)")
  parser.add_argument("--scale", type=int, default=1,
                      help="divide every size by this (a smoke run on the CPU)")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--tune", nargs="*",
                      choices=["forward", "weight_grad", "weight_grad_runs", "weight_grad_wgs"],
                      default=None,
                      help="time the Mosaic kernels' tile configurations per shape (both "
                      "kernels, or those named; weight_grad_runs: the weight gradient's "
                      "pipeline through runs of groups, weight_grad_wgs: its two compute "
                      "warpgroups, each beside the default's tiles) and print "
                      "the forward's best as a TILE_TABLES entry")
  parser.add_argument("--weight-grad-tiles", nargs="+", default=["default"], metavar="TILES",
                      help="the weight gradient's tiles, each a pass over the ops: 'default' "
                      "(configs.weight_grad_tiles) or KernelTiles' fields, comma-separated, "
                      "e.g. 128,128,64,2,4,1,2,16 (runs of 16 experts, 2 CTAs an SM); a "
                      "record's `weight_grad_tiles` names them where not the default")
  parser.add_argument("--breakdown", type=int, default=0, metavar="N",
                      help="moe_layer at one process: after each timing, the N kernels that "
                      "take the most device time per run (name, µs, launches) and how busy the "
                      "device was against the run's span, from one profiler trace")
  parser.add_argument("--plot", default=None, help="write TF/s per shape to this PNG")
  parser.add_argument("--out", default="layer.jsonl")
  args = parser.parse_args()
  tokens = max(args.tokens // args.scale, 1)
  if any(m < 1 or tokens % m for m in args.micro_batches):
    parser.error(f"--micro-batches must be positive and divide the {tokens} tokens per rank, "
                 f"got {args.micro_batches}")
  if args.calls_per_step < 1:
    parser.error(f"--calls-per-step must be positive, got {args.calls_per_step}")

  devices = jax.devices()
  num_ranks = len(devices)
  dtype = jnp.bfloat16
  records = reports.Records(args.out)
  base = dict(mode="high_throughput", ranks=num_ranks,
              process_model=reports.process_model(num_ranks), tokens_per_rank=args.tokens,
              dtype="bfloat16", wire_dtype="bfloat16")

  def add_record(op, pass_, name, experts, hidden, ffn, topk, impl, seconds, flops, bound_s,
                 **extra):
    tflops = flops / seconds / 1e12
    bound_tflops = flops / bound_s / 1e12
    records.append(reports.record(
        op=op, **{"pass": pass_}, shape=name, experts=experts, hidden=hidden, ffn=ffn,
        topk=topk, impl=impl, groups=args.groups, median_us=round(seconds * 1e6, 1),
        tflops=round(tflops, 1), bound="dense_gemm", bound_tflops=round(bound_tflops, 1),
        fraction=round(tflops / bound_tflops, 3), **{**base, **extra}))

  for name in args.shapes:
    experts, hidden, ffn, topk = (v // args.scale if i < 3 else v
                                  for i, v in enumerate(SHAPES[name]))
    experts = max(experts, topk)
    tokens = max(args.tokens // args.scale, 1)
    rows = tokens * topk
    key = jax.random.key(0)
    kx, kw, kd = jax.random.split(key, 3)
    x = jax.random.normal(kx, (rows, hidden), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (experts, hidden, ffn), jnp.float32) * hidden ** -0.5).astype(dtype)
    dy = jax.random.normal(kd, (rows, ffn), jnp.float32).astype(dtype)
    sizes = (skewed_sizes if args.groups == "skewed" else balanced_sizes)(rows, experts)
    flops = 2.0 * rows * hidden * ffn
    # The bound: a dense GEMM of the same FLOPs; beside it a batched one (equal groups).
    dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype))
    bound_s = time_fn(dense, (x, w[0]), args.repeats, f"{name} bound")
    if bound_s is None:
      continue
    m = max(rows // experts, 1)
    xb = x[: m * experts].reshape(experts, m, hidden)
    einsum = jax.jit(lambda a, b: jnp.einsum("gmk,gkn->gmn", a, b,
                                             preferred_element_type=jnp.float32).astype(dtype))
    batched_s = time_fn(einsum, (xb, w), args.repeats, f"{name} batched")
    batched = {} if batched_s is None else {
        "batched_tflops": round(flops / (batched_s * rows / (m * experts)) / 1e12, 1)}
    if args.tune is not None:
      tune(name, x, w, sizes, args.repeats, args.tune or ["forward", "weight_grad"])
    for spec in args.weight_grad_tiles:
      # Each set of tiles times every op; jax's caches cleared first, or a backward traced
      # under the previous tiles would keep its trace.
      tiles = parse_tiles(spec)
      add = functools.partial(add_record, **({} if tiles is None else
                                             {"weight_grad_tiles": spec}))
      jax.clear_caches()
      with jax_ep.experts.override(weight_grad_tiles=tiles):
        for impl in args.impls:
          which, detail = jax_ep.grouped_matmul_impl(rows, experts, hidden, ffn, dtype, impl="auto")
          if impl in ("mosaic", "jax_mosaic") and which != "mosaic":
            print(f"{name}: no Mosaic GPU run ({detail})")
            continue
          if "grouped_matmul" in args.ops:
            product = gemm_fn(impl, rows, experts, hidden, ffn)
            fwd = jax.jit(product)

            def fwd_bwd(x, w, s, dy, product=product):
              y, vjp = jax.vjp(lambda x, w: product(x, w, s), x, w)
              return y, vjp(dy)
            exact = {}
            cases = [("fwd", fwd, (x, w, sizes), flops)]
            if impl != "jax_mosaic":  # jax's kernel has no gradient of its own
              cases.append(("fwd_bwd", jax.jit(fwd_bwd), (x, w, sizes, dy), 3 * flops))
            for pass_, fn, fn_args, f in cases:
              seconds = time_fn(fn, fn_args, args.repeats, f"{name} grouped_matmul {pass_} {impl}")
              if seconds is None:
                continue
              exact[pass_] = seconds
              add("grouped_matmul", pass_, name, experts, hidden, ffn, topk, impl, seconds, f,
                  bound_s * f / flops, expert_alignment=1, **batched)
            for alignment in (a for a in args.alignments if a > 1 and impl == "mosaic"):
              # The same rows with each group starting at a multiple of `alignment` (NaN between).
              xa, dya, offsets = aligned(x, dy, sizes, alignment)

              def fwd_bwd_aligned(x, w, s, o, dy):
                y, vjp = jax.vjp(lambda x, w: jax_ep.grouped_matmul(x, w, s, group_offsets=o), x, w)
                return y, vjp(dy)
              fwd_aligned = jax.jit(lambda x, w, s, o: jax_ep.grouped_matmul(x, w, s,
                                                                             group_offsets=o))
              for pass_, fn, fn_args, f in (
                  ("fwd", fwd_aligned, (xa, w, sizes, offsets), flops),
                  ("fwd_bwd", jax.jit(fwd_bwd_aligned), (xa, w, sizes, offsets, dya), 3 * flops)):
                seconds = time_fn(fn, fn_args, args.repeats,
                                  f"{name} grouped_matmul {pass_} {impl} aligned to {alignment}")
                if seconds is not None:
                  add("grouped_matmul", pass_, name, experts, hidden, ffn, topk, impl, seconds, f,
                      bound_s * f / flops, expert_alignment=alignment, **batched)
            if args.pad > 1 and impl != "xla":
              # The same used rows at the front of a buffer `pad` times larger (NaN past them).
              padded_rows = args.pad * rows
              xp = jnp.concatenate([x, jnp.full((padded_rows - rows, hidden), jnp.nan, dtype)])
              dyp = jnp.concatenate([dy, jnp.full((padded_rows - rows, ffn), jnp.nan, dtype)])
              product = gemm_fn(impl, padded_rows, experts, hidden, ffn)

              def fwd_bwd_padded(x, w, s, dy, product=product):
                y, vjp = jax.vjp(lambda x, w: product(x, w, s), x, w)
                return y, vjp(dy)
              for pass_, fn, fn_args, f in (
                  ("fwd", jax.jit(product), (xp, w, sizes), flops),
                  ("fwd_bwd", jax.jit(fwd_bwd_padded), (xp, w, sizes, dyp), 3 * flops)):
                if pass_ not in exact:
                  continue
                seconds = time_fn(fn, fn_args, args.repeats,
                                  f"{name} grouped_matmul {pass_} {impl} padded x{args.pad}")
                if seconds is None:
                  continue
                add("grouped_matmul", pass_, name, experts, hidden, ffn, topk, impl, seconds, f,
                    bound_s * f / flops, padded_rows=padded_rows,
                    padded_ratio=round(seconds / exact[pass_], 3), **batched)
          if "moe_layer" in args.ops and impl != "jax_mosaic":
            for micro_batches in args.micro_batches:
              for precision in args.precisions:
                for weight_grad in (args.fp8_weight_grads if precision == "fp8" else [None]):
                  layer_records(name, experts, hidden, ffn, topk, tokens, impl, dtype, num_ranks,
                                args.repeats, flops, bound_s, add, micro_batches, precision,
                                args.fp8_wire, args.breakdown, args.calls_per_step, weight_grad)

  if jax.process_index() == 0:
    path = records.path
    reports.print_table(records, ["op", "pass", "shape", "impl", "precision", "micro_batches",
                                  "weight_grad_tiles", "expert_alignment", "padded_rows",
                                  "median_us", "tflops", "bound_tflops", "fraction",
                                  "padded_ratio"])
    print(f"wrote {path}")
    if args.plot:
      plot(records, args.plot)


def parse_tiles(spec: str):
  """`--weight-grad-tiles`' value: None for "default", else a `KernelTiles` of its fields."""
  if spec == "default":
    return None
  try:
    return jax_ep.experts.KernelTiles(*(int(v) for v in spec.split(",")))
  except (TypeError, ValueError) as e:
    raise SystemExit(f"--weight-grad-tiles: {spec!r} is not 'default' or up to 8 comma-separated "
                     f"integers (KernelTiles' fields in order): {e}")


def aligned(x, dy, sizes, alignment):
  """`x` and `dy`'s rows with each group starting at a multiple of `alignment`, in a buffer of
  the worst case's rows (`rows + groups * (alignment - 1)`), NaN outside the groups; and the
  groups' offsets."""
  sizes_np = np.asarray(sizes)
  spans = -(-sizes_np // alignment) * alignment
  offsets = np.cumsum(spans) - spans
  rows = x.shape[0]
  buffer_rows = rows + len(sizes_np) * (alignment - 1)
  dest = np.concatenate([offsets[g] + np.arange(n) for g, n in enumerate(sizes_np)] +
                        [np.zeros(0, np.int64)]).astype(np.int32)
  put = lambda a: jnp.full((buffer_rows, a.shape[1]), jnp.nan, a.dtype).at[dest].set(  # noqa
      a[:len(dest)])
  return put(x), put(dy), jnp.asarray(offsets.astype(np.int32))


def gemm_fn(impl, rows, experts, hidden, ffn):
  """`(x, w, sizes) -> y` of one implementation."""
  if impl == "jax_mosaic":
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    block_n = 128 if ffn % 128 == 0 else 64
    tiles_n = ffn // block_n
    band = next(b for b in (8, 4, 2, 1) if tiles_n % b == 0)
    return lambda x, w, s: ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=s, block_m=128, block_n=block_n, block_k=64, max_concurrent_steps=4,
        grid_block_n=band)
  return lambda x, w, s: jax_ep.grouped_matmul(x, w, s, impl=impl)


def layer_records(name, experts, hidden, ffn, topk, tokens, impl, dtype, num_ranks, repeats,
                  flops, bound_s, add, micro_batches=1, precision="bf16", fp8_wire=False,
                  breakdown=0, calls=1, weight_grad=None):
  """The whole layer (moe_mlp with its router, its tokens in `micro_batches`, its experts in
  `precision`, with fp8 the weight gradients in `weight_grad`: "fp8" or "bf16") forward and
  forward + backward, per call of `calls` in one program (the FP8 weights quantised once for
  all); with `breakdown`, each pass's longest kernels printed (`print_breakdown`)."""
  fp8 = precision == "fp8"
  overrides = dict(impl=impl)
  if fp8:
    weight_grad = weight_grad or "fp8"
    overrides["fp8_weight_grad"] = weight_grad == "fp8"
  wire = jax_ep.RowFormat.FP8 if fp8 and fp8_wire else None
  devices = jax.devices()
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=devices)
  experts = max(experts - experts % num_ranks, num_ranks)
  # Sized for one micro-batch (its capacity per call `micro_batches` times smaller), so the
  # split layer keeps what the unsplit one keeps.
  group = jax_ep.Group(mesh, "ep", num_experts=experts, num_topk=topk, hidden=hidden,
                       max_tokens_per_rank=tokens // micro_batches, dtype=dtype,
                       wire_format=wire)
  params = jax_ep.init_moe_params(jax.random.key(1), num_experts=experts, hidden=hidden,
                                  ffn=ffn, dtype=dtype)
  specs = jax_ep.layer.param_specs("ep", params)
  params = jax_ep.MoEParams(*(None if p is None else jax.device_put(p, NamedSharding(mesh, s))
                              for p, s in zip(params, specs)))
  x = jax.device_put(jax.random.normal(jax.random.key(2), (num_ranks * tokens, hidden),
                                       jnp.float32).astype(dtype), NamedSharding(mesh, P("ep")))

  def layer(params, x):
    # Each call on its own tokens (calls on the same ones could be computed once). With
    # several calls the FP8 weights are quantised once, here, for all of them.
    if fp8 and calls > 1:
      params = params._replace(**{n: jax_ep.quantize_weights(getattr(params, n))
                                  for n in ("w_gate", "w_up", "w_down")})
    return [jax_ep.moe_mlp(group, params, x * (1 + i / 16), micro_batches=micro_batches,
                           fp8=fp8).out for i in range(calls)]

  def fwd(params, x):
    with jax_ep.experts.override(**overrides):
      return layer(params, x)

  def fwd_bwd(params, x):
    with jax_ep.experts.override(**overrides):
      loss = lambda p, x: sum(jnp.mean(out.astype(jnp.float32) ** 2)  # noqa: E731
                              for out in layer(p, x))
      return jax.grad(loss, (0, 1))(params, x)
  layer_flops = 3 * flops  # gate, up, down
  # The experts' kernels as the layer takes them at its buffer's rows (the capacity): a record
  # says which ran (an FP8 MLP whose kernels do not build falls back per product).
  rows = group.capacity
  with jax_ep.experts.override(**overrides):
    local = experts // num_ranks
    if fp8:
      fused, kernels = mlp_fp8.fp8_mlp_impl(rows, local, hidden, ffn, "swiglu")
    else:
      fused, kernels = mlp.fused_mlp_impl(rows, local, hidden, ffn, dtype, "swiglu")
  with jax.set_mesh(mesh):
    for pass_, fn, f in (("fwd", fwd, layer_flops), ("fwd_bwd", fwd_bwd, 3 * layer_flops)):
      what = (f"{name} moe_layer {pass_} {impl} micro_batches={micro_batches} "
              f"{precision}{f' ({weight_grad} weight gradients)' if fp8 else ''}"
              f"{' fp8 wire' if wire else ''}"
              f"{f', {calls} calls' if calls > 1 else ''}")
      program = jax.jit(fn)
      program_s = time_fn(program, (params, x), repeats, what)
      if program_s is None:
        continue
      seconds = program_s / calls
      if breakdown and jax.process_count() == 1:
        print_breakdown(what, program_s, *timers.trace_breakdown(program, (params, x)),
                        breakdown)
      add("moe_layer", pass_, name, experts, hidden, ffn, topk, impl, seconds, f,
          bound_s * f / flops, micro_batches=micro_batches, precision=precision,
          fused_mlp=bool(fused), kernels=str(kernels),
          **({"wire_dtype": "float8_e4m3fn"} if wire else {}),
          **({"weight_grad": weight_grad} if fp8 else {}),
          **({"calls_per_step": calls} if calls > 1 else {}))
  group.close()


def print_breakdown(what, seconds, rows, activity, top: int):
  """The `top` kernels of one program by device time per run, and what share of the timed
  median each is (kernels on several streams may overlap: the shares can sum past 100 %)."""
  print(f"--- {what}: {seconds * 1e6:.0f} µs (median); kernels by device time per run")
  if not rows:
    print("  (no device trace)")
    return
  for kernel, us, launches in rows[:top]:
    print(f"  {us:9.1f} µs  {100 * us / (seconds * 1e6):5.1f} %  x{launches:<3d} {kernel[:110]}")
  rest = sum(us for _, us, _ in rows[top:])
  print(f"  {rest:9.1f} µs  in {max(len(rows) - top, 0)} other kernels")
  for plane, busy_us, span_us in activity:
    print(f"  {plane}: busy {busy_us:.0f} µs of a {span_us:.0f} µs span per run")


def tune(name, x, w, sizes, repeats, parts):
  """Every tile configuration the kernels take for this shape; the forward's fastest as a table
  entry."""
  rows, k = x.shape
  groups, _, n = w.shape
  if jax.devices()[0].platform != "gpu":
    print(f"{name}: --tune needs the GPU")
    return
  best = None
  # (block_n, stages, compute_wgs, CTAs per SM): one warpgroup, or two compute warpgroups (the
  # CTA's columns twice block_n) fed by a memory warpgroup; the row tile and the column band
  # apart. Two persistent CTAs of one warpgroup at 2 stages fit an SM: one's loads and MMAs
  # can fill the other's pipeline fill and store, where groups hold a tile's rows or fewer.
  # Bands up to 8 column tiles: where the forward is bound by memory (DeepSeek-V3's 256
  # experts), a row tile's column tiles walked together read its rows from DRAM once.
  kernels = ((128, 4, 1, 1), (256, 3, 1, 1), (128, 3, 2, 1), (128, 4, 2, 1), (64, 6, 2, 1),
             (128, 2, 1, 2))
  for bm, (bn, steps, wgs, per_sm), band in itertools.product(
      (64, 128), kernels if "forward" in parts else (), (1, 4, 8)):
    if n % (bn * wgs) or (n // (bn * wgs)) % band:
      continue
    config = jax_ep.experts.KernelTiles(bm, bn, 64, steps, band, wgs, per_sm)
    offsets = jnp.cumsum(sizes) - sizes
    fn = jax.jit(lambda x, w, s, c=config: hopper.grouped_matmul_kernel(
        x, w, s, offsets, transpose_w=False, tiles=c))
    seconds = time_fn(fn, (x, w, sizes), repeats, f"{name} tiles {config}")
    if seconds is None:  # e.g. a tile that does not fit shared memory
      continue
    print(f"  {name} {config}: {2.0 * rows * k * n / seconds / 1e12:.0f} TF/s")
    if best is None or seconds < best[0]:
      best = (seconds, config)
  if best is not None:
    seconds, c = best
    fields = ", ".join(str(v) for v in dataclasses.astuple(c))
    print(f"    ({groups}, {k}, {n}): KernelTiles({fields}),"
          f"  # {name}: {2.0 * rows * k * n / seconds / 1e12:.0f} TF/s")
  # The weight gradient's kernels (x^T dy per group): one warpgroup or warp-specialized, one
  # to three persistent CTAs per SM (configs.WEIGHT_GRAD_SHARED_SM_GROUPS), as many as their
  # stages and output tile fit an SM's shared memory; the rows reduced 64 or 128 at a time
  # (a group of many experts holds a block or two of 128 rows: one step each); on the rows
  # where they are (the blocks a group boundary cuts selected) or on group-aligned copies
  # (`override(weight_grad_aligned=True)`: the copies timed with the kernel).
  dy = jnp.ones((rows, n), x.dtype)
  offsets = jnp.cumsum(sizes) - sizes
  itemsize = x.dtype.itemsize

  def weight_grad(x, dy, s, config, specialized, aligned):
    return hopper_wgrad.grouped_weight_grad_kernel(x, dy, s, offsets, tiles=config,
                                             specialized=specialized, aligned=aligned)

  if {"weight_grad", "weight_grad_runs"} & set(parts):
    # The weight gradient writes all of [groups, k, n]: at many groups its store is most of its
    # DRAM bytes. The time XLA takes to fill an array of that size (a broadcast of a value it
    # cannot fold away) is the store's floor as this GPU reaches it, beside the nominal one.
    fill = jax.jit(lambda v: jnp.broadcast_to(v, (groups, k, n)))
    seconds = time_fn(fill, (jnp.ones((), x.dtype),), repeats, f"{name} write floor")
    if seconds is not None:
      print(f"  {name} weight grad's write floor: {seconds * 1e6:.0f} us, "
            f"{groups * k * n * itemsize / seconds / 1e12:.2f} TB/s (XLA filling its "
            f"[{groups}, {k}, {n}] output)")

  def time_weight_grad(config, specialized=False, aligned=False):
    fn = jax.jit(functools.partial(weight_grad, config=config, specialized=specialized,
                                   aligned=aligned))
    seconds = time_fn(fn, (x, dy, sizes), repeats, f"{name} weight grad {config}")
    if seconds is not None:
      print(f"  {name} weight grad aligned={aligned} specialized={specialized} {config}: "
            f"{2.0 * rows * k * n / seconds / 1e12:.0f} TF/s ({seconds * 1e6:.0f} us)")

  for aligned, specialized, bn, bk, steps, per_sm in itertools.product(
      (False, True), (False, True), (64, 128), (64, 128), (2, 3, 4), (1, 2, 3)):
    # The stages' buffers, or the output tile that is staged after them for its store.
    smem = max(steps * bk * (128 + bn), 128 * bn) * itemsize
    if ("weight_grad" not in parts or n % bn or k % 128
        or per_sm * (smem + 1024) > SMEM_PER_SM):
      continue
    time_weight_grad(jax_ep.experts.KernelTiles(128, bn, bk, steps, 4, ctas_per_sm=per_sm),
                     specialized, aligned)
  # The warp-specialized kernel with two compute warpgroups (`compute_wgs` 2: a 256 x 128
  # output tile, the `dy` block shared), beside the default's tiles in the same run; its ring
  # of stages and both staged tiles are held together (3 stages of 64 rows fit an SM).
  if "weight_grad_wgs" in parts and not n % 128 and not k % 256:
    default = jax_ep.experts.configs.weight_grad_tiles(k, n, groups)
    if default is not None:
      time_weight_grad(default, jax_ep.experts.configs.weight_grad_specialized())
    for aligned, steps in itertools.product((False, True), (2, 3)):
      time_weight_grad(jax_ep.experts.KernelTiles(128, 128, 64, steps, 4, compute_wgs=2),
                       specialized=True, aligned=aligned)
  # The pipeline through runs of groups (`KernelTiles.groups_per_run`: the ring of stages and
  # the staged output tile held together), on the rows in place and on aligned copies, beside
  # the default's tiles timed in the same run.
  if "weight_grad_runs" in parts and not n % 128 and not k % 128:
    default = jax_ep.experts.configs.weight_grad_tiles(k, n, groups)
    if default is not None:
      time_weight_grad(default, jax_ep.experts.configs.weight_grad_specialized())
    for aligned in (False, True):
      for config in jax_ep.experts.configs.weight_grad_run_tiles(itemsize):
        time_weight_grad(config, aligned=aligned)


def plot(records, path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"no plot ({path}): matplotlib is not installed")
    return
  series = sorted({(r["op"], r["pass"], r["impl"]) for r in records})
  shapes = sorted({r["shape"] for r in records})
  fig, ax = plt.subplots(figsize=(10, 5))
  width = 0.8 / max(len(series) + 1, 1)
  for i, (op, pass_, impl) in enumerate(series):
    values = [next((r["tflops"] for r in records if (r["op"], r["pass"], r["impl"], r["shape"])
                    == (op, pass_, impl, s)), 0.0) for s in shapes]
    ax.bar(np.arange(len(shapes)) + i * width, values, width, label=f"{op} {pass_} {impl}")
  bounds = [max((r["bound_tflops"] for r in records if r["shape"] == s), default=0.0)
            for s in shapes]
  ax.bar(np.arange(len(shapes)) + len(series) * width, bounds, width, label="batched GEMM bound")
  ax.set_xticks(np.arange(len(shapes)) + 0.4, shapes)
  ax.set_ylabel("TF/s")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
