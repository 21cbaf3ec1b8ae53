"""A decode step of several low-latency layers replayed in XLA command buffers (CUDA graphs).

Run by tests/test_cuda_local.py (one rank) and tests/test_cuda_peer.py (under the launcher).
The step is compiled with command buffers on for fusions and custom calls; 60 steps, each with
new tokens and a new routing, are checked against the numpy oracle, and the handlers' call
counters (jax_ep._native.ffi.extension().low_latency_handler_calls()) must show that the steps
replayed a recorded command buffer rather than calling the handlers each time. Prints "steps ok".
"""

import faulthandler
import os
import sys

faulthandler.dump_traceback_later(240, exit=False)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jax_ep import launch  # noqa: E402

launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from ep_test_base import host_value, local_rank_mask, make_routing, random_inputs  # noqa: E402
from low_latency_test_base import LowLatencyTestBase  # noqa: E402

NUM_LAYERS, NUM_STEPS = 4, 60
# The network transport between virtual hosts (tests/test_cuda_network.py), else the peer one.
VIRTUAL_HOSTS = int(os.environ.get("JAX_EP_VIRTUAL_HOSTS", "1"))


def main(row_format: jax_ep.RowFormat) -> int:
  fp8 = row_format.is_fp8
  r = jax.device_count()
  mesh = jax.make_mesh((r,), ("ep",), devices=jax.devices())
  e, k, h, t = 4 * r, 4, 512, 8
  group = jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
                       dtype=jnp.bfloat16, backend="cuda", low_latency=True, timeout_s=30.0,
                       virtual_hosts=VIRTUAL_HOSTS)

  def body(x, idx, w, a):
    x, idx, w, a = x[0], idx[0], w[0], a[0]
    counts = []
    for n in range(NUM_LAYERS):
      recv, handle = jax_ep.low_latency_dispatch(group, x, idx[n], row_format=row_format)
      rows = recv.x.astype(jnp.float32)
      if fp8:
        rows = (rows.reshape(*rows.shape[:-1], -1, 128) * recv.scales[..., None]).reshape(
            rows.shape)
      used = jnp.arange(rows.shape[1])[None, :, None] < recv.count[:, None, None]
      eo = (jnp.where(used, rows, 0.0) * a[n][:, None, None]).astype(jnp.bfloat16)
      x = jax_ep.low_latency_combine(group, eo, handle, w[n])
      counts.append(recv.count)
    return x[None], jnp.stack(counts)[None]

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  sharding = NamedSharding(mesh, P("ep"))

  def put(a):
    return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])
  rng = np.random.default_rng(0)
  a = (1 + 0.1 * rng.standard_normal((r, NUM_LAYERS, e // r))).astype(np.float32)
  shapes = [put(np.zeros((r, t, h), jnp.bfloat16)), put(np.zeros((r, NUM_LAYERS, t, k), np.int32)),
            put(np.zeros((r, NUM_LAYERS, t, k), np.float32)), put(a)]
  ext = jax_ep._native.ffi.extension()
  # Command buffers for fusions and custom calls, from sequences of any length.
  step = step.lower(*shapes).compile(compiler_options={
      "xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL",
      "xla_gpu_graph_min_graph_size": 1})
  calls_before, _ = ext.low_latency_handler_calls()
  mine = [int(i) for i in np.flatnonzero(local_rank_mask(mesh))]
  patterns = ["uniform", "duplicates", "one_expert", "invalid", "unused_experts", "all_masked"]
  for s in range(NUM_STEPS):
    x = random_inputs(rng, r, t, h, jnp.bfloat16)
    idx = np.stack([make_routing(rng, r, t, k, e, patterns[(s + n) % len(patterns)])
                    for n in range(NUM_LAYERS)], axis=1)
    w = (rng.random((r, NUM_LAYERS, t, k)) / k).astype(np.float32)
    out, counts = jax.tree.map(host_value, step(put(x), put(idx), put(w), put(a)))
    # With fp8 rows the oracle quantises as the kernels do (bit-exact), then dequantises.
    want, want_counts = LowLatencyTestBase._chain_oracle(x, idx, w, a, e, t, fp8=fp8)
    ok = all(np.array_equal(counts[d], want_counts[d]) for d in mine) and all(
        np.allclose(out[d].astype(np.float64), want[d], rtol=3e-2,
                    atol=3e-2 * (np.abs(want[d]).max() + 1e-30)) for d in mine)
    if not ok:
      print(f"step {s}: results differ from the oracle", flush=True)
      return 1
  calls, captured = ext.low_latency_handler_calls()
  # A replay runs the recorded kernels without calling the handlers: far fewer calls than
  # 2 ops x NUM_LAYERS x NUM_STEPS, and the ones made happened while recording.
  print(f"low-latency handler calls over {NUM_STEPS} steps: {calls - calls_before} "
        f"(recorded into a command buffer: {captured})", flush=True)
  if captured == 0 or calls - calls_before >= 2 * NUM_LAYERS * NUM_STEPS:
    print("the decode step did not replay from a command buffer", flush=True)
    return 1
  group.check()
  group.close()
  print(f"{NUM_STEPS} steps ok", flush=True)
  return 0


if __name__ == "__main__":
  fp8 = len(sys.argv) > 1 and sys.argv[1] == "fp8"
  sys.exit(main(jax_ep.RowFormat.FP8 if fp8 else jax_ep.RowFormat.PLAIN))
