"""Several processes joined by jax.distributed (CPU collectives over gloo), one EP rank each."""

import os
import subprocess
import sys

import pytest

from jax_ep import launch

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


def test_backend_suites_pass_with_one_process_per_rank():
  """The reference, API, layer and XLA-pipeline suites under `jax_ep.launch -n 2` (one CPU device
  per process), as on a multi-GPU host with one process per GPU: each process checks the ranks it
  holds, runs its own group where R is 1, and skips what only one process can do."""
  suites = [os.path.join(os.path.dirname(__file__), name) for name in (
      "test_reference.py", "test_api.py", "test_layer.py", "test_xla_pipeline.py")]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  for name in launch.CHILD_ENV_VARS:  # a job of its own, also when this run is under the launcher
    env.pop(name, None)
  cmd = [sys.executable, "-m", "jax_ep.launch", "-n", "2", "--grace", "20", "--timeout", "400",
         "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *suites]
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-20000:]
  for p in range(2):
    summary = [line for line in result.stdout.splitlines()
               if line.startswith(f"[{p}] ") and " passed" in line]
    assert summary and " failed" not in summary[-1], f"process {p}: {summary}\n{output[-5000:]}"
