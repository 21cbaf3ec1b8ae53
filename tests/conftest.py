"""Test set-up: 8 host devices on the CPU, and `jax.distributed` when started by jax_ep.launch."""

import os

# Must happen before jax is imported anywhere: 8 host devices stand in for 8 EP ranks on the CPU.
# Under jax_ep.launch each process is one rank with its own device instead.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags and "JAX_EP_PROCESS_ID" not in os.environ:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from jax_ep import launch  # noqa: E402

launch.initialize_from_env()


def pytest_collection_modifyitems(config, items):
  from jax_ep._native import ffi as _ffi
  if _ffi.cuda_available():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU and the jax_ep CUDA extension")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
