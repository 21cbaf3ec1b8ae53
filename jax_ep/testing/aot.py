"""Compiling jax_ep programs for an H200 on a machine without a GPU (ahead of time).

XLA's GPU compiler runs without a device when it is given the target's description: JAX's
CUDA PJRT plugin (`jax-cuda13-plugin` and `jax-cuda13-pjrt`, the jaxlib's version) builds
compile-only devices from it (`jax.experimental.topologies`), and a program whose arguments are
placed on them (or compiled under `jax.default_device(device)`) compiles all the way: XLA's
passes and schedule, the custom calls' lowering, and jax_ep's Mosaic GPU kernels through ptxas
for sm_90a. Nothing runs: this checks that the kernels build (their shared memory, registers,
spills: `MOSAIC_GPU_DUMP_PTXAS=1` prints ptxas's report), which kernel each shape takes, and
the order in which XLA schedules the ops, not their results.

    with jax.default_device(aot.hopper_device()):
      compiled = jax.jit(f).trace(*abstract_args).lower().compile()

The plugin is not needed to run jax_ep on a CPU and is not one of its dependencies: on a
machine without a GPU, install it apart from the environment JAX normally runs in (with it
installed, JAX tries to start the GPU backend first and logs why it cannot), e.g.
`pip install --no-deps --target DIR jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2`, and
put DIR on `PYTHONPATH` for the processes that compile (scripts/setup.sh does this for CUDA
builds: `.venv/cuda-aot`, read by tests/test_hopper_aot.py). XLA finds `ptxas` on `PATH` (a CUDA
toolkit's).
"""

from __future__ import annotations

import functools

# An H200 SXM as XLA's GPU compiler sees it (stream_executor.GpuTargetConfigProto, text form):
# the compute capability picks the code (sm_90a) and the limits the kernels are checked
# against; the rates and sizes feed XLA's cost models.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 151397597184
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200"
"""


def available() -> str | None:
  """None where compile-only H200 devices can be made here, else why not."""
  try:
    hopper_devices(1)
  except Exception as e:  # noqa: BLE001 - any failure means: not here
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  return None


@functools.cache
def hopper_devices(count: int = 1) -> tuple:
  """`count` compile-only H200 devices (one host's), from JAX's CUDA PJRT plugin and
  `H200_TARGET`. Raises where the plugin is missing (`RuntimeError` naming it)."""
  from jax.experimental import topologies
  try:
    topology = topologies.get_topology_desc(
        f"h200x{count}", platform="cuda", target_config=H200_TARGET, topology=f"1x1x{count}")
  except Exception as e:  # noqa: BLE001 - re-raised with what to install
    raise RuntimeError(
        "jax_ep.testing.aot: compile-only H200 devices need JAX's CUDA PJRT plugin "
        "(jax-cuda13-plugin and jax-cuda13-pjrt at the jaxlib's version) importable in this "
        f"process; making them failed with {type(e).__name__}: {e}") from e
  return tuple(topology.devices)


def hopper_device():
  """One compile-only H200 device (see `hopper_devices`)."""
  return hopper_devices(1)[0]


def abstract(tree, sharding):
  """`tree`'s arrays (or shape/dtype structs) as `jax.ShapeDtypeStruct`s placed by
  `sharding`: arguments for `jax.jit(f).trace(...)` that need no memory on any device."""
  import jax
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
