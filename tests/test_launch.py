"""Tests of the multi-process launcher and of the configuration check across processes (CPU)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG_WORKER = REPO / "tests" / "mp_workers" / "config_worker.py"

pytestmark = [
    pytest.mark.multiprocess,
    # These tests start launchers themselves; N launched copies of them would only repeat that.
    pytest.mark.skipif("JAX_EP_PROCESS_ID" in os.environ,
                       reason="launcher self-tests run outside a launched job"),
]


def _launch(launcher_args, cmd, *, timeout_s=60.0):
  """Runs `python -m jax_ep.launch LAUNCHER_ARGS -- CMD`; returns (result, elapsed seconds)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_EP_")}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  start = time.monotonic()
  result = subprocess.run(
      [sys.executable, "-m", "jax_ep.launch", *launcher_args, "--", *cmd],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
  return result, time.monotonic() - start


def _python(code):
  return [sys.executable, "-c", code]


def _describe(result):
  return f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_every_process_gets_its_id_and_prefix():
  code = ("import os; print('id', os.environ['JAX_EP_PROCESS_ID'], "
          "os.environ['JAX_EP_NUM_PROCESSES'], os.environ['JAX_EP_COORDINATOR'])")
  result, _ = _launch(["-n", "3"], _python(code))
  assert result.returncode == 0, _describe(result)
  coordinators = set()
  for i in range(3):
    match = re.search(rf"^\[{i}\] id {i} 3 (127\.0\.0\.1:\d+)$", result.stdout, re.MULTILINE)
    assert match, _describe(result)
    coordinators.add(match.group(1))
  assert len(coordinators) == 1, _describe(result)
  for i in range(3):
    assert f"process {i}: exit code 0" in result.stderr, _describe(result)


def test_failing_process_sets_exit_code_and_sibling_is_killed_after_grace():
  code = ("import os, sys, time\n"
          "if os.environ['JAX_EP_PROCESS_ID'] == '0': sys.exit(3)\n"
          "time.sleep(1000)\n")
  result, elapsed = _launch(["-n", "2", "--grace", "1"], _python(code))
  assert result.returncode == 3, _describe(result)
  assert elapsed < 20, f"took {elapsed:.1f} s\n{_describe(result)}"
  assert "process 0: exit code 3" in result.stderr, _describe(result)
  assert re.search(r"process 1: exit code \d+ \(killed by the launcher\)", result.stderr), (
      _describe(result))


def test_timeout_kills_hung_processes():
  result, elapsed = _launch(["-n", "2", "--timeout", "2"],
                            _python("import time; time.sleep(1000)"))
  assert result.returncode == 124, _describe(result)
  assert elapsed < 20, f"took {elapsed:.1f} s\n{_describe(result)}"
  assert result.stderr.count("(killed by the launcher)") == 2, _describe(result)


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is not None,
                    reason="CUDA MPS is installed here")
def test_share_gpu_without_mps_is_a_usage_error():
  result, _ = _launch(["-n", "2", "--share-gpu"], _python("print('must not run')"))
  assert result.returncode == 2, _describe(result)
  assert "nvidia-cuda-mps-control" in result.stderr, _describe(result)
  assert "must not run" not in result.stdout, _describe(result)


def test_child_env_for_a_shared_gpu():
  """Under --share-gpu every child uses GPU 0 without preallocating (N processes that each
  preallocated 75% of the one GPU ran out of memory on the H200), unless the caller chose an
  allocator setting, which is left alone."""
  from jax_ep import launch
  env = launch.child_env({"A": "1"}, 3, share_gpu=True, gpu_per_process=False)
  assert env == {"A": "1", launch.ENV_PROCESS_ID: "3", launch.ENV_LOCAL_DEVICE_IDS: "0",
                 launch.ENV_SHARED_GPU: "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  chosen = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"}
  env = launch.child_env(chosen, 0, share_gpu=True, gpu_per_process=False)
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in env and env[launch.ENV_SHARED_GPU] == "1"
  env = launch.child_env({}, 2, share_gpu=False, gpu_per_process=True)
  assert env == {launch.ENV_PROCESS_ID: "2", launch.ENV_LOCAL_DEVICE_IDS: "2"}
  assert launch.child_env({}, 2, share_gpu=False, gpu_per_process=False) == {
      launch.ENV_PROCESS_ID: "2"}


def test_child_env_for_isolated_gpus():
  """--isolate-gpus: child i sees only the i-th GPU the launcher could see, as its device 0."""
  from jax_ep import launch
  gpus = ["GPU-aaa", "GPU-bbb", "GPU-ccc"]
  env = launch.child_env({"CUDA_VISIBLE_DEVICES": ",".join(gpus)}, 1, share_gpu=False,
                         gpu_per_process=False, isolated_gpus=gpus)
  assert env == {"CUDA_VISIBLE_DEVICES": "GPU-bbb", launch.ENV_PROCESS_ID: "1",
                 launch.ENV_LOCAL_DEVICE_IDS: "0"}


def test_visible_gpu_ids_follow_cuda_visible_devices(monkeypatch):
  from jax_ep.launch import launcher as launch
  smi = subprocess.CompletedProcess(
      ["nvidia-smi", "-L"], 0, stdout="GPU 0: NVIDIA H200 (UUID: a)\nGPU 1: NVIDIA H200 (UUID: b)\n"
      "GPU 2: NVIDIA H200 (UUID: c)\n", stderr="")
  monkeypatch.setattr(launch.subprocess, "run", lambda *a, **k: smi)
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  assert launch._visible_gpu_ids() == ["0", "1", "2"]
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 0")
  assert launch._visible_gpu_ids() == ["2", "0"]
  assert launch._num_visible_gpus() == 2
  # More entries than GPUs: CUDA stops at the GPUs that exist.
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
  assert launch._visible_gpu_ids() == ["0", "1", "2"]


def test_isolate_gpus_needs_a_gpu_per_process(monkeypatch):
  # An empty CUDA_VISIBLE_DEVICES hides every GPU, here and on a GPU machine alike.
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
  result, _ = _launch(["-n", "2", "--isolate-gpus"], _python("print('must not run')"))
  assert result.returncode == 2, _describe(result)
  assert "--isolate-gpus needs a GPU for each of the 2 processes, but 0 are visible" in (
      result.stderr), _describe(result)
  assert "must not run" not in result.stdout, _describe(result)
  result, _ = _launch(["-n", "2", "--isolate-gpus", "--share-gpu"], _python("print(1)"))
  assert result.returncode == 2, _describe(result)
  assert "--share-gpu and --isolate-gpus exclude each other" in result.stderr, _describe(result)


def test_same_config_passes():
  result, _ = _launch(["-n", "2", "--timeout", "60"],
                      [sys.executable, str(CONFIG_WORKER), "match"])
  assert result.returncode == 0, _describe(result)
  assert result.stdout.count("config ok") == 2, _describe(result)


def test_values_gathered_through_the_key_value_store():
  result, _ = _launch(["-n", "2", "--timeout", "60"],
                      [sys.executable, str(CONFIG_WORKER), "gather"])
  assert result.returncode == 0, _describe(result)
  assert result.stdout.count("gathered value-0 value-1") == 2, _describe(result)


def test_different_config_fails_on_every_process():
  result, _ = _launch(["-n", "2", "--timeout", "60"],
                      [sys.executable, str(CONFIG_WORKER), "mismatch"])
  assert result.returncode == 17, _describe(result)
  for me, mine, peer, theirs in [(0, 128, 1, 256), (1, 256, 0, 128)]:
    expected = (f"[{me}] ValueError: jax_ep.Group: configuration differs between processes: "
                f"field 'hidden' is {mine} on process {me} but {theirs} on process {peer} "
                "(key t-0)")
    assert expected in result.stdout, _describe(result)
  assert "process 0: exit code 17" in result.stderr, _describe(result)
  assert "process 1: exit code 17" in result.stderr, _describe(result)


def test_missing_peer_times_out():
  result, elapsed = _launch(["-n", "2", "--timeout", "60"],
                            [sys.executable, str(CONFIG_WORKER), "timeout"])
  assert result.returncode == 18, _describe(result)
  assert elapsed < 30, f"took {elapsed:.1f} s\n{_describe(result)}"
  assert re.search(r"^\[0\] TimeoutError: .*process 1 .*key t-0", result.stdout,
                   re.MULTILINE), _describe(result)
  assert "process 1: exit code 0" in result.stderr, _describe(result)


def test_group_keys_of_process_subsets_are_counted_apart():
  from jax_ep.launch import _distributed
  first = _distributed.next_group_key("keys-test")
  assert _distributed.next_group_key("keys-test", [2, 0]) == "keys-test-p0.2-0"
  assert _distributed.next_group_key("keys-test", [0, 2]) == "keys-test-p0.2-1"
  assert _distributed.next_group_key("keys-test", [1]) == "keys-test-p1-0"
  # The job-wide count is not moved by the subsets' groups.
  assert _distributed.next_group_key("keys-test") == f"keys-test-{int(first.rsplit('-', 1)[1]) + 1}"
  many = list(range(12))
  key = _distributed.next_group_key("keys-test", many)
  assert key.startswith("keys-test-p") and key.endswith("-0") and len(key) < 30


class _FakeProc:
  """A child whose exit shows up between two readings of its state: `poll()` answers None
  `running_polls` times, then `code`."""

  def __init__(self, code, running_polls):
    self.code, self.running_polls, self.pid = code, running_polls, -1

  def poll(self):
    if self.running_polls > 0:
      self.running_polls -= 1
      return None
    return self.code


class _FakeChild:
  def __init__(self, index, code, running_polls):
    self.index, self.killed = index, False
    self.proc = _FakeProc(code, running_polls)

  def exit_code(self):
    rc = self.proc.poll()
    return None if rc is None else (128 - rc if rc < 0 else rc)


def test_supervisor_records_a_failure_that_lands_between_two_readings():
  """A child that fails right after its state was read must still fail the job: every reading
  of the children's states in one turn decides both "who failed" and "all exited"."""
  from jax_ep.launch import launcher as launch
  for running_polls in range(4):
    children = [_FakeChild(0, 0, 0), _FakeChild(1, 18, running_polls)]
    assert launch._supervise(children, grace_s=5.0, timeout_s=None) == 18, running_polls


def test_fast_failing_child_never_reports_success(monkeypatch):
  """Hundreds of launches whose one child fails at once: the exit code is never 0."""
  from jax_ep.launch import launcher as launch
  monkeypatch.setattr(launch, "_POLL_INTERVAL_S", 0.001)
  cmd = ["sh", "-c", 'if [ "$JAX_EP_PROCESS_ID" = 1 ]; then exit 18; fi']
  codes = [launch.launch(cmd, 2, grace_s=5.0) for _ in range(200)]
  assert codes == [18] * len(codes), sorted(set(codes))
