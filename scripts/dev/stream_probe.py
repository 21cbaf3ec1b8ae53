"""Does a jax_ep op run beside a GEMM when its custom call sits on a stream of its own?

One rank, the cuda backend. A program holds two independent chains: `--gemms` bf16 GEMMs
([rows, H] x [H, F], the experts' shape) and `--ops` dispatch -> combine pairs of T tokens.
Each is timed alone and both together (device spans from the profiler), with the ops' custom
calls on XLA's compute stream, then on another stream (`on_stream`'s variants). Prints
whether each variant compiles, the stream each kernel ran on, the optimised HLO's async ops,
and the hidden fraction `(t_gemm + t_comm - t_both) / t_comm`.

  python3 scripts/dev/stream_probe.py [--variants compute region1 meta1] [--grad] [--vmap]
"""

import argparse
import os
import re
import statistics
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import core  # noqa: E402
from jax.experimental.compute_on import compute_on  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reports  # noqa: E402
import timers  # noqa: E402
import jax_ep  # noqa: E402
from jax_ep.backends import cuda_ops  # noqa: E402

_plain_call = cuda_ops._call


def on_stream(variant):
  """`cuda_ops._call` with each custom call on another stream: `regionN` puts it alone in a
  `compute_on("gpu_stream:N")` region (N may be `collective`), `metaN` annotates the custom
  call's op itself (`set_xla_metadata`); `...seq` also batches every call sequentially under
  vmap (as the multi-rank ops do)."""
  from jax.experimental.xla_metadata import set_xla_metadata
  seq = variant.endswith("seq")
  name = variant.removesuffix("seq")
  kind, stream = ("region", name[6:]) if name.startswith("region") else ("meta", name[4:])

  def call(target, result_shapes, *args, **kwargs):
    if seq:
      kwargs["vmap_method"] = "sequential"
    if name == "compute":
      return _plain_call(target, result_shapes, *args, **kwargs)
    if kind == "meta":
      with set_xla_metadata(_xla_stream_annotation=stream):
        return _plain_call(target, result_shapes, *args, **kwargs)
    region = compute_on(compute_type=f"gpu_stream:{stream}",
                        out_memory_spaces=core.MemorySpace.Device)
    return region(lambda *a: _plain_call(target, result_shapes, *a, **kwargs))(*args)
  return call


def entry_order(hlo: str) -> str:
  """The ENTRY computation's async ops, custom calls and fusions, in schedule order."""
  out, inside = [], False
  for ln in hlo.splitlines():
    if ln.startswith("ENTRY"):
      inside = True
      continue
    if inside and ln.startswith("}"):
      break
    if inside and "=" in ln:
      found = re.search(r"\s([a-z][a-z0-9-]*)\(", ln.split("=", 1)[1])
      op = found.group(1) if found else ""
      if op in ("fusion", "custom-call", "call-start", "call-done", "async-start", "async-done",
                "while", "call"):
        tag = op
        if op == "custom-call" and 'custom_call_target="' in ln:
          tag = ln.split('custom_call_target="')[1].split('"')[0]
        out.append(tag.replace("jax_ep_", ""))
  runs = []
  for tag in out:
    if runs and runs[-1][0] == tag:
      runs[-1][1] += 1
    else:
      runs.append([tag, 1])
  return " ".join(tag if n == 1 else f"{tag}x{n}" for tag, n in runs)


def stream_events(run, repeats):
  """(stream line, kernel name, start, end) of every GPU event of `repeats` runs."""
  import glob
  import tempfile
  from jax._src.lib import _profile_data
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for r in range(repeats):
      jax.block_until_ready(run(r))
    jax.profiler.stop_trace()
    (path,) = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    prof = _profile_data.ProfileData.from_file(path)
    out = []
    for plane in prof.planes:
      if plane.name.startswith("/device:GPU"):
        for line in plane.lines:
          if line.name.startswith("Stream"):
            out += [(line.name, ev.name, ev.start_ns, ev.start_ns + ev.duration_ns)
                    for ev in line.events]
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--experts", type=int, default=32)
  ap.add_argument("--hidden", type=int, default=7168)
  ap.add_argument("--ffn", type=int, default=2048)
  ap.add_argument("--gemms", type=int, default=6)
  ap.add_argument("--ops", type=int, default=3)
  ap.add_argument("--variants", nargs="+",
                  default=["compute", "library", "region1", "meta1", "regioncollective",
                           "computeseq", "meta1seq", "region1seq"],
                  help="library: the group's own comm_stream=1; the others patch its calls")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--backend", default="cuda", help="reference: a CPU check of the probe itself")
  ap.add_argument("--grad", action="store_true", help="also the ops under jax.grad")
  ap.add_argument("--vmap", action="store_true", help="also the ops under jax.vmap (2)")
  a = ap.parse_args()
  t, e, h, f, k = a.tokens, a.experts, a.hidden, a.ffn, 8
  rng = np.random.default_rng(0)
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  make_group = lambda stream: jax_ep.Group(
      mesh, "ep", num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
      dtype=jnp.bfloat16, backend=a.backend, comm_stream=stream)
  groups = {None: make_group(None), 1: make_group(1)}
  group = groups[None]
  x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
  idx = jnp.asarray(reports.uniform_topk(rng, t, e, k))
  w = jnp.asarray(rng.random((t, k)), jnp.float32)
  rows = jnp.asarray(rng.standard_normal((t * k, h)) * 0.05, jnp.bfloat16)
  wg = jnp.asarray(rng.standard_normal((h, f)) * 0.05, jnp.bfloat16)

  def comm(x, idx, w):
    group = groups[1 if variant == "library" else None]
    for _ in range(a.ops):
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      x = jax_ep.combine(group, recv.x, handle).astype(x.dtype)
    return x

  def gemms(rows, wg):
    acc = jnp.zeros((rows.shape[0], wg.shape[1]), jnp.float32)
    for i in range(a.gemms):
      acc = acc + jnp.dot(rows * (1 + i / 64), wg, preferred_element_type=jnp.float32)
    return acc

  sm = lambda fn, n_in, n_out: jax.jit(jax.shard_map(
      fn, mesh=mesh, in_specs=(P(),) * n_in, out_specs=(P(),) * n_out if n_out > 1 else P(),
      check_vma=False))
  programs = {
      "gemm": sm(lambda x, idx, w, r, g: gemms(r, g), 5, 1),
      "comm": sm(lambda x, idx, w, r, g: comm(x, idx, w), 5, 1),
      "both": sm(lambda x, idx, w, r, g: (comm(x, idx, w), gemms(r, g)), 5, 2),
  }
  if a.grad:
    loss = lambda x, w: jnp.sum(comm(x, idx, w).astype(jnp.float32) ** 2)
    programs["comm_grad"] = sm(lambda x, idx, w, r, g: jax.grad(loss, (0, 1))(x, w), 5, 2)
    programs["both_grad"] = sm(lambda x, idx, w, r, g: (*jax.grad(loss, (0, 1))(x, w),
                                                        gemms(r, g)), 5, 3)
  if a.vmap:
    programs["comm_vmap"] = sm(lambda x, idx, w, r, g: jax.vmap(
        lambda xx: comm(xx, idx, w))(jnp.stack([x, x * 2])), 5, 1)
  args = (x, idx, w, rows, wg)

  results = {}
  for variant in a.variants:
    cuda_ops._call = on_stream("compute" if variant == "library" else variant)
    jax.clear_caches()  # the programs are traced again, through this variant's calls
    for name, prog in programs.items():
      print(f"\n=== {variant} {name}", flush=True)
      try:
        compiled = prog.lower(*args).compile()
        hlo = compiled.as_text()
        lines = [ln.strip()[:160] for ln in hlo.splitlines()
                 if any(s in ln for s in ("-start", "-done", "_xla_stream", "operation_queue"))]
        print(f"  compiled; async/stream lines in the optimised HLO: {len(lines)}")
        for ln in lines[:6]:
          print("   ", ln)
        print("  entry order:", entry_order(hlo)[:600])
        out = jax.block_until_ready(compiled(*args))
        spans = timers.split_runs(
            [(s, e_) for _, _, s, e_ in stream_events(lambda r: compiled(*args), a.repeats)],
            a.repeats)
        events = stream_events(lambda r: compiled(*args), 1)
        by_stream = {}
        for line, kname, s, e_ in events:
          by_stream.setdefault(line, []).append(kname[:40])
        for line, names in by_stream.items():
          print(f"  {line}: {len(names)} kernels, e.g. {sorted(set(names))[:4]}")
        med = statistics.median(spans) * 1e6 if spans else float("nan")
        results[(variant, name)] = med
        print(f"  device span median {med:.1f} us over {len(spans)} runs")
        first = jax.tree.leaves(out)[0]
        results[(variant, name, "out")] = np.asarray(first.astype(jnp.float32))
      except Exception as ex:  # noqa: BLE001 - a probe reports every failure and goes on
        print(f"  FAILED: {type(ex).__name__}: {str(ex)[:1500]}")
        traceback.print_exc(limit=3)
  cuda_ops._call = _plain_call

  print("\n=== summary (us)")
  for variant in a.variants:
    g, c, b = (results.get((variant, n)) for n in ("gemm", "comm", "both"))
    line = f"{variant:8s} gemm {g} comm {c} both {b}"
    if None not in (g, c, b):
      line += f"  hidden {(g + c - b) / c:.2f}"
    for n in ("comm", "both", "comm_grad", "comm_vmap"):
      ours = results.get((variant, n, "out"))
      base = results.get(("compute", n, "out"))
      if ours is not None and base is not None and variant != "compute":
        line += f"  {n} max|diff| {float(np.max(np.abs(ours - base))):.3g}"
    print(line)


if __name__ == "__main__":
  main()
