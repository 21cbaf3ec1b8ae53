"""scripts/gpu_suite.py's record of a suite, on the CPU: what it counts when the suite passes,
and when it is cut by its time limit (interrupted, its summary and failures still in the log);
and tests/conftest.py's stop after a CUDA error that loses the process's context and its
release of a failed test's values."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TESTS = '''
import time
def test_passes():
  pass
def test_fails():
  assert 1 == 2, "the failure's own message"
def test_hangs():
  time.sleep(600)
'''


def _suite(tmp_path, select, timeout):
  tmp_path.mkdir(exist_ok=True)
  (tmp_path / "test_cases.py").write_text(TESTS)
  out = tmp_path / "out"
  # `-p conftest`: tests/conftest.py's hooks for a test file outside tests/.
  env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests"), JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "gpu_suite.py"), "--out", str(out),
       "--timeout", str(timeout), "--name", "cases", "--", sys.executable, "-m", "pytest", "-q",
       "-p", "no:cacheprovider", "-p", "conftest", str(tmp_path / "test_cases.py"), "-k",
       select],
      env=env, capture_output=True, text=True, timeout=timeout + 60)
  (record,) = [json.loads(line) for line in open(out / "gpu_suites.jsonl")]
  return result, record, (out / "logs" / "cases.log").read_text()


def test_a_passing_suite_is_recorded_as_passed(tmp_path):
  result, record, _ = _suite(tmp_path, "passes", 120)
  assert result.returncode == 0, result.stdout + result.stderr
  assert (record["passed"], record["failed"], record["skipped"], record["errors"],
          record["exit_code"]) == (1, 0, 0, 0, 0), record
  # Where the suite's time went: its tests, longest first (rank 0's report).
  (name, seconds), = record["slowest_tests"]
  assert name == "test_passes" and 0 <= seconds < 60, record


def test_a_suite_past_its_time_is_interrupted_and_counts_what_ran(tmp_path):
  for timeout in (30, 120):
    result, record, log = _suite(tmp_path / str(timeout), "passes or fails or hangs", timeout)
    if record["passed"] + record["failed"] == 2:
      break
    # Cut before the two tests ran: on a loaded machine pytest's start (jax's and jax_ep's
    # imports in tests/conftest.py) can outlast 30 s; the same run again with more time.
  assert result.returncode == 1, result.stdout + result.stderr
  # The tests that ran, and one error for the cut (the hanging test is not a pass).
  assert (record["passed"], record["failed"], record["errors"], record["exit_code"]) == (
      1, 1, 1, 124), record
  # The failure went to the log when it happened, and pytest's summary says where it stopped.
  assert re.search(r"FAILED \S*test_cases\.py::test_fails \(call\)", log), log
  assert "the failure's own message" in log
  assert "KeyboardInterrupt" in log and "test_cases.py:8" in log


STICKY = '''
def test_loses_the_context():
  raise RuntimeError("CUDA error: CUDA_ERROR_MISALIGNED_ADDRESS: misaligned address")
def test_after_it():
  pass
'''


def _pytest_with_conftest(tmp_path, tests: str):
  """pytest over `tests` (a module's text) with tests/conftest.py's hooks, on the CPU."""
  (tmp_path / "test_cases.py").write_text(tests)
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
       str(tmp_path / "test_cases.py")],
      env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests"), JAX_PLATFORMS="cpu"),
      capture_output=True, text=True, timeout=120)


def test_a_lost_cuda_context_stops_the_run(tmp_path):
  """After a CUDA error that loses the process's context, pytest stops there (the tests after
  it would all fail with it), and the record says so."""
  result = _pytest_with_conftest(tmp_path, STICKY)
  assert result.returncode == 2, result.stdout + result.stderr  # pytest's "interrupted"
  assert "1 failed in" in result.stdout and "passed" not in result.stdout, result.stdout
  assert "lost this process's CUDA context (CUDA_ERROR_MISALIGNED_ADDRESS)" in result.stdout


HELD = '''
import weakref
REFS = []
class Big:  # stands in for a device array
  pass
def test_fails_holding_a_big_value():
  big = Big()
  REFS.append(weakref.ref(big))
  cycle = {}
  cycle["self"] = cycle  # a reference cycle through the failing frame, as pytest's reports make
  cycle["frame"] = __import__("sys")._getframe()
  assert big is None
def test_after_it_the_value_is_gone():
  assert REFS and REFS[0]() is None
'''


def test_a_failed_tests_values_are_freed_before_the_next_test(tmp_path):
  """A failed test's frames (its device arrays: tens of GB at the models' shapes) are held by
  pytest's post-mortem references and reference cycles; the next test does not run beside
  them."""
  result = _pytest_with_conftest(tmp_path, HELD)
  assert "1 failed, 1 passed" in result.stdout, result.stdout + result.stderr
