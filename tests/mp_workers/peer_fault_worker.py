"""Fault cases of the peer transport, two processes (see tests/test_cuda_peer.py).

  skip_call: rank 1 never calls dispatch; rank 0 must get a TimeoutError naming the op, itself
             and rank 1 within the group's timeout, then both close the group and exit 0.
  mismatch:  the processes pass different `hidden`; both must fail at group creation.
"""

import sys
import time

from jax_ep import launch

launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402


def main(mode):
  me = jax.process_index()
  mesh = jax.make_mesh((jax.process_count(),), ("ep",), devices=jax.devices())
  hidden = 256 if mode == "mismatch" and me == 1 else 128
  try:
    group = jax_ep.Group(mesh, "ep", num_experts=8, num_topk=2, hidden=hidden,
                         max_tokens_per_rank=16, dtype=jnp.bfloat16, backend="cuda",
                         timeout_s=2.0, config_timeout_s=30)
  except ValueError as e:
    print(f"process {me}: {e}", flush=True)
    return 0 if mode == "mismatch" else 1
  if mode == "mismatch":
    return 1

  if me == 1:
    time.sleep(8)  # never dispatches; rank 0 must give up after timeout_s
    group.close()
    return 0
  sharding = NamedSharding(mesh, P("ep"))
  x = jax.make_array_from_callback((2, 16, 128), sharding,
                                   lambda i: np.ones((2, 16, 128), jnp.bfloat16)[i])
  idx = jax.make_array_from_callback((2, 16, 2), sharding,
                                     lambda i: np.tile(np.array([0, 5], np.int32), (2, 16, 1))[i])
  w = jax.make_array_from_callback((2, 16, 2), sharding,
                                   lambda i: np.ones((2, 16, 2), np.float32)[i])
  body = lambda x, i, w: jax_ep.dispatch(group, x[0], i[0], w[0])[0].x[None]
  start = time.monotonic()
  try:
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)
    jax.block_until_ready(out)
    print("process 0: dispatch returned without a timeout", flush=True)
    return 1
  except Exception as e:  # noqa: BLE001 - the timeout arrives wrapped in JAX's runtime error
    elapsed = time.monotonic() - start
    print(f"process 0: raised after {elapsed:.1f} s: {e}", flush=True)
  finally:
    group.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
