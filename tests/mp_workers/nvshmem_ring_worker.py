"""NVSHMEM in jax_ep's processes: join by unique id through jax.distributed, then a put-with-signal
ring over every PE (jax_ep.backends.nvshmem.ring_probe). Run by tests/test_nvshmem.py under the
launcher (several processes sharing one GPU, or one per GPU). Prints "ring ok" with the PE and the
initialisation status.
"""

import faulthandler
import os
import sys

faulthandler.dump_traceback_later(120, exit=False)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jax_ep import launch  # noqa: E402

launch.initialize_from_env()

import jax  # noqa: E402

from jax_ep.backends import nvshmem  # noqa: E402


def main() -> int:
  if os.environ.get("JAX_EP_SHARED_GPU") == "1":
    nvshmem.apply_env(nvshmem.shared_gpu_env())
  rank, num_ranks = jax.process_index(), jax.process_count()
  device = jax.local_devices()[0].local_hardware_id
  member = nvshmem.join("ring-probe", rank, num_ranks, device, timeout_s=60.0)
  assert (member.pe, member.num_pes) == (rank, num_ranks), member
  # Twice: the second round runs on freshly allocated symmetric memory after the first's free.
  for size in (4096, 1 << 20):
    if not nvshmem.ring_probe(size, timeout_s=20.0):
      print(f"ring FAILED: PE {member.pe} of {member.num_pes}, {size} bytes", flush=True)
      return 1
  print(f"ring ok: PE {member.pe} of {member.num_pes}, status {member.status}, "
        f"NVSHMEM {nvshmem.load().library_version()}", flush=True)
  nvshmem.load().finalize()
  return 0


if __name__ == "__main__":
  sys.exit(main())
