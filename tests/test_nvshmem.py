"""NVSHMEM for the network transport (jax_ep/backends/nvshmem.py, ffi/nvshmem/).

On the CPU: the unique-id exchange through a key-value store (against an in-memory one), the
errors a user sees when NVSHMEM is missing or mismatched, and, where jax_ep was built against the
installed wheel, that the module loads with matching versions. On a GPU (marked `gpu`): processes
sharing the GPU under MPS, or one per GPU, join NVSHMEM by unique id and pass a put-with-signal
ring over every PE.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import jax
import pytest

from ep_test_base import require_nvshmem
from jax_ep.backends import nvshmem

RING_WORKER = os.path.join(os.path.dirname(__file__), "mp_workers", "nvshmem_ring_worker.py")


class FakeKeyValueStore:
  """The two calls of jax.distributed's client that the exchange uses."""

  def __init__(self):
    self._values: dict[str, bytes] = {}
    self._cv = threading.Condition()

  def key_value_set_bytes(self, key, value):
    with self._cv:
      self._values[key] = bytes(value)
      self._cv.notify_all()

  def blocking_key_value_get_bytes(self, key, timeout_in_ms):
    deadline = time.monotonic() + timeout_in_ms / 1000
    with self._cv:
      while key not in self._values:
        left = deadline - time.monotonic()
        if left <= 0:
          raise RuntimeError(f"DEADLINE_EXCEEDED: key {key} not found")
        self._cv.wait(left)
      return self._values[key]


def test_unique_id_reaches_every_rank():
  store = FakeKeyValueStore()
  made = []

  def make_id():
    made.append(1)
    return bytes(range(128))

  got = {}

  def rank(r):
    got[r] = nvshmem.exchange_unique_id("g-0", r, 4, timeout_s=5.0, make_id=make_id,
                                        client=store)
  threads = [threading.Thread(target=rank, args=(r,)) for r in (3, 1, 2)]
  for t in threads:
    t.start()
  rank(0)
  for t in threads:
    t.join()
  assert made == [1], "only the first rank makes the id"
  assert got == {r: bytes(range(128)) for r in range(4)}


def test_missing_first_rank_is_a_timeout():
  store = FakeKeyValueStore()
  start = time.monotonic()
  with pytest.raises(TimeoutError, match=r"did not publish NVSHMEM's unique id within 0.2 s"):
    nvshmem.exchange_unique_id("g-1", 2, 4, timeout_s=0.2, make_id=lambda: b"", client=store)
  assert time.monotonic() - start < 5.0


def test_exchange_checks_its_arguments():
  store = FakeKeyValueStore()
  with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), got 4"):
    nvshmem.exchange_unique_id("g-2", 4, 4, timeout_s=1.0, make_id=lambda: b"", client=store)
  with pytest.raises(RuntimeError, match="unique id is 128 bytes, got 3"):
    nvshmem.exchange_unique_id("g-3", 0, 2, timeout_s=1.0, make_id=lambda: b"abc", client=store)
  # One process needs no store.
  assert nvshmem.exchange_unique_id("g-4", 0, 1, timeout_s=1.0, make_id=lambda: b"x" * 128,
                                    client=None) == b"x" * 128


def test_settings_do_not_override_the_users(monkeypatch):
  monkeypatch.setenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "eth7")
  monkeypatch.delenv("NVSHMEM_DISABLE_NCCL", raising=False)
  monkeypatch.delenv("NVSHMEM_REMOTE_TRANSPORT", raising=False)
  monkeypatch.delenv("NVSHMEM_IGNORE_CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
  applied = nvshmem.apply_env(nvshmem.shared_gpu_env())
  assert os.environ["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "eth7"
  assert "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME" not in applied
  assert applied["NVSHMEM_DISABLE_NCCL"] == "1"
  assert applied["NVSHMEM_REMOTE_TRANSPORT"] == "none"


def test_missing_wheel_is_a_clear_error(monkeypatch):
  monkeypatch.setattr(nvshmem, "_module", None)
  monkeypatch.setattr(nvshmem, "wheel_root", lambda: None)
  with pytest.raises(nvshmem.NvshmemUnavailable, match="pip install nvidia-nvshmem-cu13"):
    nvshmem.load()
  assert not nvshmem.available()


def test_version_mismatch_is_a_clear_error(monkeypatch, tmp_path):
  if nvshmem.wheel_root() is None:
    pytest.skip("needs the nvidia-nvshmem-cu13 wheel")

  class Module:
    @staticmethod
    def compiled_version():
      return "3.0.0"

    @staticmethod
    def library_version():
      return "3.4.5"

  monkeypatch.setattr(nvshmem, "_module", None)
  real_import = nvshmem.importlib.import_module
  monkeypatch.setattr(nvshmem.importlib, "import_module",
                      lambda name: Module if name == "jax_ep._jax_ep_nvshmem" else
                      real_import(name))
  with pytest.raises(nvshmem.NvshmemUnavailable,
                     match=r"built against NVSHMEM 3.0.0, but .* host library is 3.4.5"):
    nvshmem.load()


def test_module_matches_the_installed_wheel():
  """Where jax_ep was built with NVSHMEM (the wheel present at build time), the module loads
  here, without a GPU, and its build and the host library agree."""
  if nvshmem.wheel_root() is None:
    pytest.skip("the nvidia-nvshmem-cu13 wheel is not installed")
  try:
    module = nvshmem.load()
  except nvshmem.NvshmemUnavailable as e:
    if "no NVSHMEM module" in str(e):
      pytest.skip("jax_ep was built without its NVSHMEM module")
    raise
  assert module.compiled_version() == module.library_version()
  assert module.init_status() == 0  # nothing initialised it in this process


def _launch(num_ranks: int, share_gpu: bool) -> subprocess.CompletedProcess:
  cmd = [sys.executable, "-m", "jax_ep.launch", "-n", str(num_ranks), "--grace", "20",
         "--timeout", "150"]
  if share_gpu:
    cmd.append("--share-gpu")
  cmd += ["--", sys.executable, RING_WORKER]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=200)


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(jax.process_count() > 1, reason="starts its own processes")
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_ring_on_one_gpu(num_ranks):
  """`num_ranks` processes share GPU 0 under MPS, each its own PE (NVSHMEM's several PEs per
  GPU), joined by unique id; every PE's put-with-signal arrives intact at the next."""
  require_nvshmem()
  result = _launch(num_ranks, share_gpu=True)
  log = result.stdout + result.stderr
  assert result.returncode == 0, log
  assert log.count("ring ok") == num_ranks, log


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(jax.process_count() > 1, reason="starts its own processes")
def test_ring_one_process_per_gpu():
  require_nvshmem()
  if len([d for d in jax.devices() if d.platform == "gpu"]) < 2:
    pytest.skip("needs two GPUs")
  result = _launch(2, share_gpu=False)
  log = result.stdout + result.stderr
  assert result.returncode == 0, log
  assert log.count("ring ok") == 2, log


def test_symmetric_heap_size_holds_the_groups_buffers():
  """NVSHMEM sizes its heap once: room for the first group's buffer four times over, at least
  2 GiB, in whole MiB."""
  mib = 1 << 20
  assert nvshmem.symmetric_heap_size(1) == 2 << 30
  big = 3 << 30
  size = nvshmem.symmetric_heap_size(big)
  assert size >= 4 * big and size % mib == 0 and size - (4 * big + 64 * mib) < mib


def test_the_high_throughput_ops_need_hosts_of_equal_size():
  from jax_ep.backends import NetworkBackend
  from jax_ep.backends.options import CommOptions
  from jax_ep.config import EPConfig
  backend = NetworkBackend(EPConfig("ep", 2, 4, 2, 128, 4, "bfloat16", 8), 1, CommOptions(), 1)
  for call in (lambda: backend.dispatch(None, None, None),
               lambda: backend.dispatch_cached(None, None), lambda: backend.combine(None, None),
               lambda: backend.combine_vjp(None, None, None, None)):
    with pytest.raises(NotImplementedError, match="needs hosts of equal size"):
      call()
