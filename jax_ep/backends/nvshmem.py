"""NVSHMEM for the network transport: loading the module, and joining NVSHMEM by unique id.

NVSHMEM comes from the `nvidia-nvshmem-cu13` wheel. The extension module
`jax_ep._jax_ep_nvshmem` is built against that wheel's headers and device library when the wheel
is installed at build time (CMakeLists.txt, `JAX_EP_ENABLE_NVSHMEM`), and needs its host library
`libnvshmem_host.so.3` loaded first, which `load()` does from the same wheel, checking that the
versions agree. NVSHMEM reads its settings from the environment when it initialises (docs/
multihost.md lists the ones that matter).

Bootstrap (`join`): the group's first process creates a unique id, the `jax.distributed`
key-value store carries it, and every process initialises as PE = its index in the group. A
process that never arrives is a `TimeoutError` before NVSHMEM is touched, never a hang. If
NVSHMEM is already initialised in the process (by another library, or an earlier group) with the
same PE numbering, it is used as it is.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
import threading
from collections.abc import Mapping

from jax._src import distributed as jax_distributed

_KEY_PREFIX = "jax_ep/nvshmem"
_UNIQUE_ID_BYTES = 128
_STATUS_IS_INITIALIZED = 2  # NVSHMEM_STATUS_IS_INITIALIZED

_lock = threading.Lock()
_module = None
_host_library = None


class NvshmemUnavailable(RuntimeError):
  """NVSHMEM cannot be used in this installation (the message says why and what to do)."""


def wheel_root() -> str | None:
  """The `nvidia-nvshmem-cu13` wheel's directory (include/, lib/), or None if not installed."""
  try:
    package = importlib.import_module("nvidia.nvshmem")
  except ImportError:
    return None
  paths = list(getattr(package, "__path__", []))
  return paths[0] if paths else None


def load():
  """The `_jax_ep_nvshmem` module, with NVSHMEM's host library loaded; raises
  NvshmemUnavailable naming what is missing."""
  global _module, _host_library
  with _lock:
    if _module is not None:
      return _module
    root = wheel_root()
    if root is None:
      raise NvshmemUnavailable(
          "jax_ep: NVSHMEM is not installed (the network transport needs it): "
          "pip install nvidia-nvshmem-cu13, then rebuild jax_ep so that it builds its NVSHMEM "
          "module against the same wheel")
    library = os.path.join(root, "lib", "libnvshmem_host.so.3")
    try:
      # RTLD_GLOBAL: the module's NEEDED entry (libnvshmem_host.so.3) resolves to this copy,
      # and NVSHMEM's bootstrap and transport plugins find its symbols.
      _host_library = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
      raise NvshmemUnavailable(f"jax_ep: cannot load NVSHMEM's host library {library}: {e}") from e
    try:
      module = importlib.import_module("jax_ep._jax_ep_nvshmem")
    except ImportError as e:
      raise NvshmemUnavailable(
          "jax_ep: this installation has no NVSHMEM module (built without NVSHMEM, or "
          "JAX_EP_ENABLE_NVSHMEM=OFF): install nvidia-nvshmem-cu13 and rebuild jax_ep "
          f"({e})") from e
    compiled, loaded = module.compiled_version(), module.library_version()
    if compiled != loaded:
      raise NvshmemUnavailable(
          f"jax_ep: the NVSHMEM module was built against NVSHMEM {compiled}, but the installed "
          f"wheel's host library is {loaded} ({library}); rebuild jax_ep against this wheel, or "
          f"install nvidia-nvshmem-cu13=={compiled}")
    _module = module
    return module


def available() -> bool:
  """Whether `load()` succeeds here (NVSHMEM installed and jax_ep built against it)."""
  try:
    load()
  except NvshmemUnavailable:
    return False
  return True


def shared_gpu_env() -> dict[str, str]:
  """The NVSHMEM settings for PEs that share one GPU under CUDA MPS (the emulated hosts of the
  tests): NVSHMEM's own transports only (no NCCL inside it, no network) and its unique-id
  bootstrap on the loopback interface. NVSHMEM's several-PEs-per-GPU mode also asks that the
  processes' MPS thread shares sum to at most 100; a share must be set before the process's CUDA
  context exists, which JAX has created by the time a group is, so the check is waived instead
  (NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): jax_ep's kernels bound their own grids
  so that the ranks' spinning blocks fit the GPU together (docs/low_latency.md)."""
  return {
      "NVSHMEM_DISABLE_NCCL": "1",
      "NVSHMEM_REMOTE_TRANSPORT": "none",
      "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
      "NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1",
  }


def apply_env(settings: Mapping[str, str]) -> dict[str, str]:
  """Sets each variable that is not already set (the user's settings win); returns those
  set. NVSHMEM reads them when it initialises, so this must come before `join`."""
  applied = {}
  for name, value in settings.items():
    if name not in os.environ:
      os.environ[name] = value
      applied[name] = value
  return applied


@dataclasses.dataclass(frozen=True)
class Membership:
  """This process's place in NVSHMEM after `join`."""
  pe: int
  num_pes: int
  status: int  # nvshmemx_init_status(): 2 initialised, 3 / 4 several PEs per GPU
  joined_existing: bool


def _is_deadline_error(e: Exception) -> bool:
  text = str(e).lower()
  return "deadline_exceeded" in text or "deadline exceeded" in text or "timed out" in text


def exchange_unique_id(key: str, rank: int, num_ranks: int, *, timeout_s: float,
                       make_id, client=None) -> bytes:
  """The group's unique id: rank 0 makes it (`make_id()`) and publishes it under `key`; the
  others wait for it up to `timeout_s` (TimeoutError naming rank 0 and the key)."""
  if not 0 <= rank < num_ranks:
    raise ValueError(f"jax_ep.nvshmem: rank must be in [0, {num_ranks}), got {rank}")
  if num_ranks == 1:
    return make_id()
  if client is None:
    client = jax_distributed.global_state.client
    if client is None:
      raise RuntimeError("jax_ep.nvshmem: a group of several processes needs jax.distributed "
                         "(jax.distributed.initialize) to carry NVSHMEM's unique id")
  path = f"{_KEY_PREFIX}/{key}/unique_id"
  if rank == 0:
    uid = make_id()
    if len(uid) != _UNIQUE_ID_BYTES:
      raise RuntimeError(f"jax_ep.nvshmem: a unique id is {_UNIQUE_ID_BYTES} bytes, got "
                         f"{len(uid)}")
    client.key_value_set_bytes(path, uid)
    return uid
  try:
    uid = client.blocking_key_value_get_bytes(path, max(1, int(timeout_s * 1000)))
  except Exception as e:  # jax.errors.JaxRuntimeError carries the gRPC status
    if not _is_deadline_error(e):
      raise
    raise TimeoutError(
        f"jax_ep.nvshmem: the group's first process did not publish NVSHMEM's unique id within "
        f"{timeout_s:g} s (key {path}, seen from rank {rank} of {num_ranks}); did every process "
        "create the same groups in the same order?") from e
  return bytes(uid)


def join(key: str, rank: int, num_ranks: int, device: int, *, timeout_s: float = 60.0,
         client=None) -> Membership:
  """Joins NVSHMEM as PE `rank` of `num_ranks` on local CUDA device `device`, by unique id
  through the key-value store (`key` unique per group and the same on every process)."""
  module = load()
  if module.init_status() >= _STATUS_IS_INITIALIZED:
    # Already a PE (an earlier group, or another library): no new id; init checks the numbering.
    uid = b""
  else:
    uid = exchange_unique_id(key, rank, num_ranks, timeout_s=timeout_s,
                             make_id=module.unique_id, client=client)
  r = module.init(uid, rank, num_ranks, device)
  return Membership(pe=r["pe"], num_pes=r["num_pes"], status=r["status"],
                    joined_existing=r["joined"])


def symmetric_heap_size(buffer_bytes: int) -> int:
  """The symmetric heap jax_ep asks for when it initialises NVSHMEM for a group whose buffer
  has `buffer_bytes` (NVSHMEM_SYMMETRIC_SIZE, unless set): NVSHMEM's heap is sized once, at
  initialisation, and later groups of the process allocate from it too, so room for this
  group's buffer four times over and at least 2 GiB, in whole MiB."""
  mib = 1 << 20
  want = max(2 << 30, 4 * int(buffer_bytes) + 64 * mib)
  return (want + mib - 1) // mib * mib


def ring_probe(num_bytes: int = 1 << 20, timeout_s: float = 20.0) -> bool:
  """Collective over the PEs: each puts `num_bytes` with a signal to the next and checks what
  the previous one put (the first thing to run where NVSHMEM is new: transports, MPS)."""
  return bool(load().ring_probe(num_bytes, timeout_s))
