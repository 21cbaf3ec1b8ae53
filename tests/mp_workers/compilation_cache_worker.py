"""One process of tests/test_group_ids.py: programs on groups created in different orders, with
jax's persistent compilation cache shared between the processes.

  compilation_cache_worker.py ROLE BACKEND MODE DIR

ROLE:
  first   creates groups A then B (one configuration) and runs the step on B; exports that
          program to DIR/program_on_b.bin (`jax.export`, group id and configuration in it).
  second  creates B then A and runs the step on B, then on A, then the exported program.
  other   creates C (A's configuration) then D (a larger capacity) and runs the exported
          program: on the cuda backend its group id names D here, a group of another
          configuration, which the handlers refuse with a message naming the field.
MODE: high_throughput (dispatch + combine) or low_latency (the fused low-latency pair).

The cache lives in DIR/cache. Every run is checked against the numpy oracle. Prints one line
`RESULT {json}`: per run, whether it matched the oracle, the persistent cache hits its
compilation had, and the first line of its error if it raised.
"""

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import export  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from ep_test_base import make_routing, random_inputs  # noqa: E402
from jax_ep._native import effects, ffi  # noqa: E402
from jax_ep.testing import oracle  # noqa: E402

_HITS = [0]


def _count_hits(event, **_):
  if event == "/jax/compilation_cache/cache_hits":
    _HITS[0] += 1


def _groups(mesh, backend, low_latency, names, capacity=None):
  r = mesh.devices.size
  return {name: jax_ep.Group(mesh, "ep", num_experts=4 * r, num_topk=2, hidden=256,
                             max_tokens_per_rank=8, dtype=_dtype(low_latency), backend=backend,
                             low_latency=low_latency, capacity=capacity, timeout_s=30.0)
          for name in names}


def _dtype(low_latency):
  # f32 for the high-throughput pair: its partials are f32 too, so the oracle's bound is tight.
  return jnp.bfloat16 if low_latency else jnp.float32


def _step(group, low_latency):
  def body(x, idx, w):
    x, idx, w = x[0], idx[0], w[0]
    if low_latency:
      recv, handle = jax_ep.low_latency_dispatch(group, x, idx)
      used = jnp.arange(recv.x.shape[1])[None, :, None] < recv.count[:, None, None]
      out = jax_ep.low_latency_combine(group, jnp.where(used, recv.x, 0), handle, w)
    else:
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      out = jax_ep.combine(group, recv.x, handle)
    return out[None]
  return jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))


def _inputs(mesh, low_latency):
  r = mesh.devices.size
  e, k, h, t = 4 * r, 2, 256, 8
  rng = np.random.default_rng(0)
  x = random_inputs(rng, r, t, h, _dtype(low_latency))
  idx = make_routing(rng, r, t, k, e, "duplicates")
  w = (rng.random((r, t, k)) / k).astype(np.float32)
  sharding = NamedSharding(mesh, P("ep"))
  arrays = [jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i])
            for a in (x, idx, w)]
  return (x, idx, w), arrays


def _want(host, group, low_latency):
  x, idx, w = host
  e, t = group.config.num_experts, group.config.max_tokens_per_rank
  if low_latency:
    got = oracle.low_latency_dispatch(x, idx, e, t)
    return oracle.low_latency_combine([d["recv_x"] for d in got], got, w, np.float64)
  got = oracle.dispatch(x, idx, e, group.capacity)
  return oracle.combine([d["recv_x"] for d in got], got, w, np.float64)


def _matches(out, want, low_latency):
  out = np.asarray(out).astype(np.float64)
  if low_latency:
    return bool(np.allclose(out, want, rtol=3e-2, atol=3e-2 * (np.abs(want).max() + 1e-30)))
  return bool(np.allclose(out, want, rtol=1e-5, atol=1e-5))


def _run(results, name, compile_fn, args, want, low_latency):
  """Compiles (counting persistent cache hits), runs and checks one program."""
  before = _HITS[0]
  entry = {"hits": 0, "ok": False, "error": None}
  try:
    compiled = compile_fn()
    entry["hits"] = _HITS[0] - before
    entry["ok"] = _matches(jax.block_until_ready(compiled(*args)), want, low_latency)
  except Exception as e:  # noqa: BLE001 - reported to the test, which decides
    entry["hits"] = _HITS[0] - before
    entry["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0]
    traceback.print_exc()
    effects.settle()  # the failed execution's effect token, or exit re-raises it
  results[name] = entry


def main(role, backend, mode, directory):
  jax.config.update("jax_compilation_cache_dir", os.path.join(directory, "cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.monitoring.register_event_listener(_count_hits)
  low_latency = mode == "low_latency"
  r = 2 if backend == "reference" else jax.device_count()
  mesh = jax.make_mesh((r,), ("ep",), devices=jax.devices()[:r])
  host, args = _inputs(mesh, low_latency)
  exported_path = os.path.join(directory, f"program_on_b_{mode}.bin")
  results = {}

  if role == "first":
    groups = _groups(mesh, backend, low_latency, ["A", "B"])
    step = _step(groups["B"], low_latency)
    _run(results, "B", lambda: step.lower(*args).compile(), args,
         _want(host, groups["B"], low_latency), low_latency)
    targets = sorted(ffi.extension().registrations()) if ffi.extension() is not None else []
    exported = export.export(step, disabled_checks=[
        export.DisabledSafetyCheck.custom_call(t) for t in targets])(*args)
    with open(exported_path, "wb") as f:
      f.write(exported.serialize())
  else:
    if role == "second":
      groups = _groups(mesh, backend, low_latency, ["B", "A"])
      for name in ("B", "A"):
        step = _step(groups[name], low_latency)
        _run(results, name, lambda step=step: step.lower(*args).compile(), args,
             _want(host, groups[name], low_latency), low_latency)
      want_group = groups["A"]
    else:
      # C has A and B's configuration; D, the group the exported program's id names here, a
      # larger capacity.
      groups = _groups(mesh, backend, low_latency, ["C"])
      groups.update(_groups(mesh, backend, low_latency, ["D"],
                            capacity=groups["C"].capacity + 16))
      want_group = groups["D"]
    with open(exported_path, "rb") as f:
      exported = export.deserialize(bytearray(f.read()))
    # Nothing drops at either capacity, so the oracle's result is the same for both.
    _run(results, "exported", lambda: jax.jit(exported.call).lower(*args).compile(), args,
         _want(host, want_group, low_latency), low_latency)
  for group in groups.values():
    group.close()
  print("RESULT " + json.dumps(results), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:5]))
