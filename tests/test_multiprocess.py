"""Several processes joined by jax.distributed (CPU collectives over gloo), one EP rank each."""

import os
import subprocess
import sys

import pytest

from jax_ep import launch

WORKER = os.path.join(os.path.dirname(__file__), "mp_workers", "dispatch_worker.py")

pytestmark = pytest.mark.multiprocess


def _one_device_per_process():
  """This run's XLA_FLAGS (tests/conftest.py's compile settings) less the host device count:
  one CPU device per process."""
  return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                  if not f.startswith("--xla_force_host_platform_device_count"))


def _launch(num_processes, *worker_args, timeout=240):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_one_device_per_process())
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
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_one_device_per_process())
  cmd = [sys.executable, "-m", "jax_ep.launch", "-n", "3", "--grace", "20", "--timeout", "100",
         "--", sys.executable, worker]
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
  for p in range(3):
    assert f"process {p}: peer bootstrap exchanged 3 handles in rank order" in result.stdout
  for p in range(2):
    assert f"process {p}: subset group closed with its members" in result.stdout, (
        result.stdout + result.stderr)


def _run_suites_under_launcher(num_processes, suites, *pytest_args, timeout=420):
  """`pytest suites` under `jax_ep.launch -n num_processes` (one CPU device per process);
  asserts that every process passed some tests and failed none."""
  if os.environ.get(launch.ENV_PROCESS_ID) is not None:
    pytest.skip("already one process of a launched job: would start a job per process")
  paths = [os.path.join(os.path.dirname(__file__), name) for name in suites]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_one_device_per_process())
  cmd = [sys.executable, "-m", "jax_ep.launch", "-n", str(num_processes), "--grace", "20",
         "--timeout", str(timeout - 20), "--", sys.executable, "-m", "pytest", "-q", "-p",
         "no:cacheprovider", *pytest_args, *paths]
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-20000:]
  for p in range(num_processes):
    summary = [line for line in result.stdout.splitlines()
               if line.startswith(f"[{p}] ") and " passed" in line]
    assert summary and " failed" not in summary[-1], f"process {p}: {summary}\n{output[-5000:]}"


@pytest.mark.slow
def test_backend_suites_pass_with_one_process_per_rank():
  """The reference, API, layer and XLA-pipeline suites under `jax_ep.launch -n 2`, as on a
  multi-GPU host with one process per GPU: each process checks the ranks it holds and runs its
  own group where R is 1."""
  _run_suites_under_launcher(2, ["test_reference.py", "test_api.py", "test_layer.py",
                                 "test_xla_pipeline.py"])


@pytest.mark.slow
def test_groups_over_some_of_the_processes():
  """Four processes, groups of 1, 2 and 4 ranks: a group over some of the processes is created,
  checked and counted by its members alone (test_experts_equal_ranks creates two groups in a
  row; before, processes outside the first skipped the second and every later check paired
  different groups)."""
  _run_suites_under_launcher(4, ["test_reference.py", "test_api.py"], "-k",
                             "experts_equal_ranks or out_of_range or dispatch_combine_uniform "
                             "or low_latency_roundtrip", timeout=300)
