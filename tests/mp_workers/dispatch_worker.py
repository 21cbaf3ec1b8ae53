"""One EP rank per process: dispatch/combine across processes, checked against the oracle.

Started by tests/test_multiprocess.py through `python -m jax_ep.launch -n N -- python THIS ...`.
Exit codes: 0 pass, 1 wrong result, 17 the group raised ValueError (printed) — used by the
configuration-mismatch case.
"""

import argparse
import sys

from jax_ep import launch

launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.testing import oracle  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--mismatch", default=None, help="field=value used by process 1 only")
  parser.add_argument("--backend", default="auto")
  args = parser.parse_args()

  num_ranks = jax.process_count()
  me = jax.process_index()
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices())
  config = dict(num_experts=4 * num_ranks, num_topk=3, hidden=256, max_tokens_per_rank=19,
                dtype=jnp.bfloat16)
  if args.mismatch and me == 1:
    field, value = args.mismatch.split("=")
    config[field] = int(value)
  try:
    group = jax_ep.Group(mesh, "ep", backend=args.backend, config_timeout_s=30, **config)
  except ValueError as e:
    print(f"group creation failed: {e}", flush=True)
    return 17

  rng = np.random.default_rng(1234)  # same data on every process; each feeds its own shard
  num_tokens, k, e, h = 19, 3, group.num_experts, group.hidden
  x = np.asarray(jnp.asarray(rng.standard_normal((num_ranks, num_tokens, h)), jnp.bfloat16))
  idx = np.stack([np.argsort(rng.random((num_tokens, e)), axis=-1)[:, :k]
                  for _ in range(num_ranks)]).astype(np.int32)
  idx[0, :5] = -1  # rank 0's first tokens select nothing
  w = rng.random((num_ranks, num_tokens, k)).astype(np.float32)
  eo = np.asarray(jnp.asarray(rng.standard_normal((num_ranks, group.capacity, h)), jnp.bfloat16))

  sharding = NamedSharding(mesh, P("ep"))
  glob = [jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i])
          for a in (x, idx, w, eo)]

  def body(x, idx, w, eo):
    recv, handle = jax_ep.dispatch(group, x[0], idx[0], w[0])
    out = jax_ep.combine(group, eo[0], handle)
    return recv.x[None], recv.group_sizes[None], recv.num_dropped[None], out[None]

  outs = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*glob)
  rank = list(mesh.devices.flat).index(jax.local_devices()[0])
  recv_x, sizes, dropped, out = (np.asarray(o.addressable_shards[0].data)[0] for o in outs)

  expected = oracle.dispatch(x, idx, e, group.capacity)[rank]
  np.testing.assert_array_equal(recv_x, expected["recv_x"])
  np.testing.assert_array_equal(sizes, expected["group_sizes"])
  assert dropped == expected["num_dropped"]
  want = oracle.combine(list(eo), oracle.dispatch(x, idx, e, group.capacity), w, np.float64)[rank]
  np.testing.assert_allclose(out.astype(np.float64), want, rtol=1.6e-2, atol=1.6e-2)
  print(f"rank {rank} of {num_ranks} ({group.backend_name}): dispatch and combine match the "
        f"oracle ({int(sizes.sum())} rows received)", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
