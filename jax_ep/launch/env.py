"""The child side of `python -m jax_ep.launch`: joining the job its environment describes.

The launcher (`jax_ep/launch/launcher.py`) sets these variables in every process it starts; a
process joins the `jax.distributed` job with `initialize_from_env()` (exported as
`jax_ep.launch.initialize_from_env`) before its first JAX computation.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading

ENV_COORDINATOR = "JAX_EP_COORDINATOR"
ENV_NUM_PROCESSES = "JAX_EP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_EP_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_EP_LOCAL_DEVICE_IDS"
ENV_SHARED_GPU = "JAX_EP_SHARED_GPU"
# Everything the launcher sets for its children that ties a process to this job: a command that
# a child starts as a job of its own must not inherit them.
CHILD_ENV_VARS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICE_IDS,
                  ENV_SHARED_GPU)

_initialized_from_env = False
_initialize_lock = threading.Lock()


def _platform_is_cpu() -> bool:
  """Whether this process's JAX will run on CPU, decided without creating a backend.

  No backend may exist before `jax.distributed.initialize`, so `jax.default_backend()` cannot
  be asked; the requested platforms and the installed accelerator plugins decide instead.
  """
  import jax

  platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return "cpu" in [p.strip().lower() for p in platforms.split(",")]
  # No explicit platform: JAX picks an accelerator when a plugin for one is installed.
  if list(importlib.metadata.entry_points(group="jax_plugins")):
    return False
  try:
    import jax_plugins  # Namespace package of the older plugin discovery mechanism.
  except ImportError:
    return True
  return not any(os.listdir(p) for p in getattr(jax_plugins, "__path__", []))


def initialize_from_env(*, cpu_collectives: str | None = "gloo") -> bool:
  """Joins the `jax.distributed` job that `python -m jax_ep.launch` describes in the environment.

  Call it before any JAX computation. Without `JAX_EP_PROCESS_ID` in the environment (a plain
  single-process run) it does nothing.

  Args:
    cpu_collectives: `jax_cpu_collectives_implementation` to set when JAX runs on CPU, so that
      collectives across processes work there; `None` leaves the setting alone.

  Returns:
    True when this process belongs to a launched job and `jax.distributed` is initialized (by
    this call or an earlier one: repeated calls do nothing more); False when the launcher's
    variables are absent.
  """
  global _initialized_from_env
  process_id = os.environ.get(ENV_PROCESS_ID)
  if process_id is None:
    return False
  with _initialize_lock:
    if _initialized_from_env:
      return True
    import jax
    from jax._src import distributed as jax_distributed

    if jax_distributed.global_state.client is not None:
      # The process already joined a job (e.g. through its own jax.distributed.initialize).
      _initialized_from_env = True
      return True

    coordinator = os.environ.get(ENV_COORDINATOR)
    num_processes = os.environ.get(ENV_NUM_PROCESSES)
    if not coordinator or not num_processes:
      raise RuntimeError(
          f"{ENV_PROCESS_ID}={process_id} is set, so {ENV_COORDINATOR} (got "
          f"{coordinator!r}) and {ENV_NUM_PROCESSES} (got {num_processes!r}) must be set "
          "too; start the processes with `python -m jax_ep.launch`")
    kwargs: dict[str, object] = {}
    local_device_ids = os.environ.get(ENV_LOCAL_DEVICE_IDS, "").strip()
    if local_device_ids:
      kwargs["local_device_ids"] = [int(x) for x in local_device_ids.split(",")]
    if cpu_collectives is not None and _platform_is_cpu():
      jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(num_processes),
        process_id=int(process_id),
        # Everything is given explicitly: a cluster environment the launcher runs inside
        # (SLURM, Open MPI, ...) must not override it.
        cluster_detection_method="deactivate",
        **kwargs,
    )
    _initialized_from_env = True
    return True
