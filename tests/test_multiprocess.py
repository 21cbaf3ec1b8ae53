"""Several processes joined by jax.distributed (CPU collectives over gloo), one EP rank each."""

import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "mp_workers", "dispatch_worker.py")

pytestmark = pytest.mark.multiprocess


def _launch(num_processes, *worker_args, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  cmd = [sys.executable, "-m", "jax_ep.launch", "-n", str(num_processes), "--grace", "20",
         "--timeout", str(timeout - 20), "--", sys.executable, WORKER, *worker_args]
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_dispatch_combine_across_four_processes():
  result = _launch(4, "--backend", "reference")
  assert result.returncode == 0, result.stdout + result.stderr
  for rank in range(4):
    assert f"rank {rank} of 4 (reference): dispatch and combine match the oracle" in result.stdout


def test_configuration_mismatch_fails_at_group_creation():
  result = _launch(2, "--backend", "reference", "--mismatch", "hidden=128")
  assert result.returncode == 17, result.stdout + result.stderr
  # Both processes name the field that differs; neither hangs.
  assert result.stdout.count("configuration differs between processes: field 'hidden'") == 2, (
      result.stdout + result.stderr)


def test_peer_transport_bootstrap_exchanges_handles_in_rank_order():
  worker = os.path.join(os.path.dirname(__file__), "mp_workers", "peer_bootstrap_worker.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, "-m", "jax_ep.launch", "-n", "3", "--grace", "20", "--timeout", "100",
         "--", sys.executable, worker]
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
  for p in range(3):
    assert f"process {p}: peer bootstrap exchanged 3 handles in rank order" in result.stdout
