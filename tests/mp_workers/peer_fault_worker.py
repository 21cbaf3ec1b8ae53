"""Fault cases of the peer transport, two processes (see tests/test_cuda_peer.py).

  skip_call:       rank 1 never calls dispatch. With the default settings rank 0's dispatch
                   gives up after the group's timeout and returns (no host check inside the
                   op); the watchdog logs the timeout, `group.check()` raises `TimeoutError`
                   naming the op, rank 0 and rank 1, and the next call of the same program
                   fails at once with that text. Then both close the group and exit 0.
  skip_call_debug: the same with `raise_on_timeout=True`: the dispatch itself raises.
  skip_low_latency: rank 1 never calls low_latency_dispatch; as skip_call (its wait times out).
  With JAX_EP_VIRTUAL_HOSTS=k the group spans k virtual hosts (the network transport): then
  skip_call's dispatch waits in the rail exchange and skip_low_latency's in its own wait.
  mismatch:        the processes pass different `hidden`; both must fail at group creation.
"""

import faulthandler
import os
import sys
import time

from jax_ep import launch

# Each mode finishes in ~20 s; a hang prints every thread's stack before the launcher's
# timeout kills the process, so the log says where it stopped.
faulthandler.dump_traceback_later(60, exit=False)
launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

# The network transport between virtual hosts (tests/test_cuda_network.py), else the peer one.
VIRTUAL_HOSTS = int(os.environ.get("JAX_EP_VIRTUAL_HOSTS", "1"))


def main(mode):
  me = jax.process_index()
  mesh = jax.make_mesh((jax.process_count(),), ("ep",), devices=jax.devices())
  hidden = 256 if mode == "mismatch" and me == 1 else 128
  try:
    group = jax_ep.Group(mesh, "ep", num_experts=8, num_topk=2, hidden=hidden,
                         max_tokens_per_rank=16, dtype=jnp.bfloat16, backend="cuda",
                         timeout_s=2.0, config_timeout_s=30,
                         raise_on_timeout=mode == "skip_call_debug",
                         low_latency=mode == "skip_low_latency",
                         virtual_hosts=VIRTUAL_HOSTS if mode != "mismatch" else None)
  except ValueError as e:
    print(f"process {me}: {e}", flush=True)
    return 0 if mode == "mismatch" else 1
  if mode == "mismatch":
    return 1

  sharding = NamedSharding(mesh, P("ep"))
  x = jax.make_array_from_callback((2, 16, 128), sharding,
                                   lambda i: np.ones((2, 16, 128), jnp.bfloat16)[i])
  idx = jax.make_array_from_callback((2, 16, 2), sharding,
                                     lambda i: np.tile(np.array([0, 5], np.int32), (2, 16, 1))[i])
  w = jax.make_array_from_callback((2, 16, 2), sharding,
                                   lambda i: np.ones((2, 16, 2), np.float32)[i])
  if mode == "skip_low_latency":
    body = lambda x, i, w: jax_ep.low_latency_dispatch(group, x[0], i[0])[0].count[None]
  else:
    body = lambda x, i, w: jax_ep.dispatch(group, x[0], i[0], w[0])[0].x[None]
  # NOTES: both processes compile the step: compiling a program over several processes' devices
  # is itself collective (XLA shares autotuning results between the processes), so a process
  # that never compiles it leaves the other stuck in compilation, before any jax_ep kernel runs
  # (seen on the H200). The fault under test is a peer that skips the call at run time.
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  step = step.lower(x, idx, w).compile()
  if me == 1:
    time.sleep(8)  # never dispatches; rank 0 must give up after timeout_s
    group.close()
    return 0
  start = time.monotonic()
  try:
    if mode == "skip_call_debug":
      try:
        jax.block_until_ready(step(x, idx, w))
        print("process 0: dispatch returned without a timeout", flush=True)
        return 1
      except Exception as e:  # noqa: BLE001 - the timeout arrives wrapped in JAX's runtime error
        print(f"process 0: raised after {time.monotonic() - start:.1f} s: {e}", flush=True)
        return 0
    jax.block_until_ready(step(x, idx, w))  # the kernels gave up; the outputs are defined
    elapsed = time.monotonic() - start
    try:
      group.check()
      print("process 0: check() found no timeout", flush=True)
      return 1
    except TimeoutError as e:
      print(f"process 0: check() raised after {elapsed:.1f} s: {e}", flush=True)
    try:
      jax.block_until_ready(step(x, idx, w))
      print("process 0: the next call ran although the group timed out", flush=True)
      return 1
    except Exception as e:  # noqa: BLE001 - the handler's error, wrapped by JAX
      print(f"process 0: next call failed: {str(e).splitlines()[0][:400]}", flush=True)
  finally:
    group.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1]))
