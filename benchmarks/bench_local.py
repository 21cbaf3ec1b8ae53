"""One-rank (R=1) dispatch and combine: cuda kernels vs the reference backend vs plain XLA.

Run on a GPU:  python benchmarks/bench_local.py [--tokens 128 4096 16384] [--out FILE.jsonl]

For each T it times, per backend, `dispatch` (layout + permute into the expert-grouped layout)
and `combine` (weighted fp32 reduction back to `[T, H]`), plus the cuda `layout` alone, and
prints a table; one JSON Lines record per measurement goes to benchmarks/results/ with the keys
of DESIGN.md section 6. `min_hbm_bytes`: dispatch reads x once and writes every selected row;
combine reads every selected row and writes `[T, H]`. `roofline` = (min_hbm_bytes / copy bound)
/ median time. `bytes`/`gbps` follow the field's accounting (rows received, deduplicated per
rank: at R=1 one row per token).

Timing (`--timing`, records say which in `calls_per_run`): `single` (default) runs one op per
executable, one run after another, cycling through `--calls` input sets. `batch` runs `--calls`
independent ops per executable and divides. Neither is the whole truth at small sizes: in a
batch XLA's command buffers run independent fusions concurrently (which a model with one op per
layer does not get); a single small executable gets no command buffer, so a multi-kernel op pays
host launch gaps inside its span (the cuda layout alone, three launches: 25 us single against
12 us batched at T=4096; XLA's many-kernel dispatch likewise). Compare like with like.
`fresh` (combine only, GPU only): as `single`, but each run first rewrites the expert rows with
an elementwise kernel (x * 1, behind an optimization barrier with every other input, so that
XLA can neither fuse it into its combine nor start the combine before it), as the expert MLP
before a combine leaves them: in the L2 where they fit. The time is the run's span after that
kernel (`timing="device_trace_fresh_rows"`; the first run's kernel names are printed).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import bounds  # noqa: E402
import reports  # noqa: E402
import timers  # noqa: E402
import jax_ep  # noqa: E402


def xla_dispatch(x, topk_idx, num_experts):
  """Plain XLA: stable argsort of the slots by expert, gather the token rows."""
  num_topk = topk_idx.shape[1]
  order = jnp.argsort(topk_idx.reshape(-1), stable=True)
  recv = jnp.take(x, order // num_topk, axis=0)
  group_sizes = jnp.bincount(topk_idx.reshape(-1), length=num_experts).astype(jnp.int32)
  return recv, group_sizes, order


def xla_combine(expert_out, order, topk_weights):
  """Plain XLA: invert the permutation, gather each slot's row, fp32 weighted sum."""
  num_tokens, num_topk = topk_weights.shape
  position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  rows = jnp.take(expert_out, position.reshape(num_tokens, num_topk), axis=0)
  out = jnp.einsum("tkh,tk->th", rows.astype(jnp.float32), topk_weights)
  return out.astype(expert_out.dtype)


def batched(fn):
  """Runs `fn` on every input set of a batch in one executable (independent calls)."""
  return jax.jit(lambda *sets: [fn(*args) for args in zip(*sets)])


def bench_tokens(num_tokens, hidden, num_topk, num_experts, bound_gbps, bound_name, calls,
                 backends, breakdown=False, timings=("single",)):
  rng = np.random.default_rng(num_tokens)
  dtype = jnp.bfloat16
  itemsize = 2
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  sharding = NamedSharding(mesh, P())
  put = lambda a: jax.device_put(a, sharding)
  # Rows are drawn on the device: at T=16384 the expert outputs alone are 15 GB over 8 sets,
  # which numpy took minutes to draw (in float64) and copy in.
  keys = iter(jax.random.split(jax.random.key(num_tokens), 2 * calls))
  normal = lambda shape: put(jax.random.normal(next(keys), shape, dtype))
  xs = [normal((num_tokens, hidden)) for _ in range(calls)]
  idxs = [put(reports.uniform_topk(rng, num_tokens, num_experts, num_topk)) for _ in range(calls)]
  ws = [put(rng.random((num_tokens, num_topk)).astype(np.float32)) for _ in range(calls)]
  rows = num_tokens * num_topk
  eos = [normal((rows, hidden)) for _ in range(calls)]
  row_bytes = hidden * itemsize
  min_bytes = (num_tokens + rows) * row_bytes
  base = dict(mode="high_throughput", ranks=1, process_model="single_device",
              tokens_per_rank=num_tokens, hidden=hidden, topk=num_topk, experts=num_experts,
              dtype="bfloat16", wire_dtype="bfloat16", bytes=num_tokens * row_bytes,
              bound_gbps=round(bound_gbps, 1), bound=bound_name)
  records = []

  def add(op, backend, fn, sets, min_hbm=min_bytes):
    """Times `fn` over the input sets (`sets`: one list per argument) in every timing mode."""
    if breakdown and jax.devices()[0].platform == "gpu":
      print(f"T={num_tokens} {op} {backend}: device time per call by kernel (us, launches; "
            f"batches of {calls} independent calls)")
      traced = batched(fn)
      jax.block_until_ready(traced(*sets))  # compile outside the trace
      for name, us, launches in timers.kernel_breakdown(traced, sets)[:8]:
        print(f"  {us / calls:9.2f}  {launches / calls:4.1f}  {name[:90]}")
    for mode in timings:
      if mode == "fresh":
        if op != "combine":
          continue
        # The rewrite is the run's first kernel: every input of the combine passes the barrier
        # with the rewritten rows, so none of its kernels can be scheduled before the rewrite.
        # The factor is an argument: a constant 1 would be folded away, with the rewrite.
        fresh = lambda one, eo, *rest: fn(*jax.lax.optimization_barrier((eo * one, *rest)))
        fresh_sets = [(jnp.ones((), dtype), *args) for args in zip(*sets)]
        if jax.devices()[0].platform != "gpu":
          jax.block_until_ready(jax.jit(fresh)(*fresh_sets[0]))  # it builds and runs
          print(f"T={num_tokens} {op} {backend}: no fresh-rows timing (it needs a GPU trace)")
          continue
        seconds, timing = timers.time_single_calls(jax.jit(fresh), fresh_sets,
                                                   skip_leading_kernels=1)
        if timing != "device_trace_single":  # no trace, or runs without a kernel after it
          print(f"T={num_tokens} {op} {backend}: no fresh-rows timing (no device trace with a "
                "kernel after the rewrite)")
          continue
        timing = "device_trace_fresh_rows"
      elif mode == "single":
        seconds, timing = timers.time_single_calls(jax.jit(fn), list(zip(*sets)))
      else:
        seconds, timing = timers.time_batches(batched(fn), sets)
        seconds /= calls
      median_us = seconds * 1e6
      records.append(reports.record(
          op=op, backend=backend, median_us=round(median_us, 2), timing=timing,
          calls_per_run=calls if mode == "batch" else 1, **base,
          gbps=round(base["bytes"] / (median_us * 1e-6) / 1e9, 1), min_hbm_bytes=min_hbm,
          roofline=round(min_hbm / (bound_gbps * 1e9) / (median_us * 1e-6), 3)))

  for backend in (b for b in backends if b != "xla_baseline"):
    group = jax_ep.Group(mesh, "ep", num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                         max_tokens_per_rank=num_tokens, dtype=dtype, backend=backend)

    def per_shard(fn):
      return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)

    dispatch = per_shard(lambda x, i, w: jax_ep.dispatch(group, x, i, w))
    recv_handles = [jax.jit(dispatch)(x, i, w) for x, i, w in zip(xs, idxs, ws)]
    handles = [h for _, h in recv_handles]
    combine = per_shard(lambda eo, h: jax_ep.combine(group, eo, h))
    add("dispatch", backend, dispatch, (xs, idxs, ws))
    add("combine", backend, combine, (eos, handles))
    if backend == "cuda":
      layout = per_shard(lambda i: group.backend.layout(i)[0])
      add("layout", backend, layout, (idxs,), min_hbm=rows * 4 * 2)  # read ids, write rows

  if "xla_baseline" in backends:
    xla_d = functools.partial(xla_dispatch, num_experts=num_experts)
    orders = [jax.jit(xla_d)(x, i)[2] for x, i in zip(xs, idxs)]
    add("dispatch", "xla_baseline", xla_d, (xs, idxs))
    add("combine", "xla_baseline", xla_combine, (eos, orders, ws))
  return records


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096, 16384])
  parser.add_argument("--hidden", type=int, default=7168)
  parser.add_argument("--topk", type=int, default=8)
  parser.add_argument("--experts", type=int, default=256)
  parser.add_argument("--calls", type=int, default=8,
                      help="input sets (rotated through; also the size of a timed batch)")
  parser.add_argument("--timing", nargs="+", choices=["single", "batch", "fresh"],
                      default=["single"],
                      help="single: one op per run, runs one after another (an op's latency in "
                      "a layer stack); batch: a run of --calls independent ops, time per op "
                      "(XLA may overlap independent fusions there); fresh: combine as single, "
                      "its expert rows just rewritten (GPU)")
  parser.add_argument("--backends", nargs="+", default=["cuda", "reference", "xla_baseline"],
                      choices=["cuda", "reference", "xla_baseline"],
                      help="xla_baseline: the plain-XLA formulation (argsort + take; gather + "
                      "weighted sum)")
  parser.add_argument("--out", default="local.jsonl")
  parser.add_argument("--breakdown", action="store_true",
                      help="also print each timed op's device time per kernel (GPU)")
  args = parser.parse_args()
  bound_gbps, bound_name = bounds.copy_bound_gbps()
  print(f"copy bound: {bound_gbps:.0f} GB/s ({bound_name}) on {reports.device_name()}")
  records = []
  for t in args.tokens:
    records += bench_tokens(t, args.hidden, args.topk, args.experts, bound_gbps, bound_name,
                            args.calls, args.backends, args.breakdown, args.timing)
  path = reports.write_jsonl(records, args.out)
  reports.print_table(records, ["op", "backend", "tokens_per_rank", "calls_per_run", "timing",
                               "median_us", "gbps", "min_hbm_bytes", "roofline"])
  by = {(r["op"], r["backend"], r["tokens_per_rank"], r["calls_per_run"], r["timing"]):
        r["median_us"] for r in records}
  for (op, backend, t, per_run, timing), cuda in by.items():
    if backend != "cuda" or op == "layout":
      continue
    ratios = ", ".join(f"x{by[(op, other, t, per_run, timing)] / cuda:.2f} vs {other}"
                       for other in ("reference", "xla_baseline")
                       if (op, other, t, per_run, timing) in by)
    print(f"T={t} {op} ({per_run} call(s) per run, {timing}): cuda {cuda:.1f} us, {ratios}")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
