"""scripts/check_status.py says which parts of the GPU check have passing records at a commit:
the steps and their suites come from gpu_round.sh's dry run, a record counts at its own commit
only, the last of a suite's records wins, and what is left is printed as gpu_round.sh steps,
packed into calls by each suite's longest measured time."""

import json
import os
import sys
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_status  # noqa: E402


@pytest.fixture(scope="module")
def steps():
  return check_status.check_steps()


def _records(steps, commit, failed=()):
  """A passing record of every suite of the check at `commit`, those of the `failed` steps
  failing."""
  return [{"op": "gpu_suite", "suite": suite, "ranks": ranks, "virtual_hosts": hosts,
           "passed": 3, "failed": int(step in failed), "skipped": 0, "errors": 0,
           "commit": commit}
          for _, step, suites in steps for suite, ranks, hosts in suites]


def test_the_check_is_every_part_and_each_step_runs_a_suite(steps):
  assert [part for part, _, _ in steps][0] == "check1"
  assert {part for part, _, _ in steps} == {f"check{n}" for n in range(1, 10)}
  assert all(suites for _, _, suites in steps), steps
  names = {step: suites for _, step, suites in steps}
  assert ("tests/test_cuda_peer.py", 8, None) in names["peer8"]
  assert ("tests/test_cuda_network.py", 8, 4) in names["network4"]
  # The sanitizer runs are named by their tool and -k selection, four in one step.
  assert len(names["peer_sanitize"]) == 4
  assert names["peer_sanitize"][0][0] == (
      "memcheck:tests/test_cuda_peer.py -k 'test_dispatch_combine_uniform and 128-3-8'")


def test_a_whole_check_at_one_commit_passes(steps, tmp_path, capsys):
  path = tmp_path / "records.jsonl"
  records = _records(steps, "abc1234") + _records(steps, "0ther00", failed={"peer2"})
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  assert check_status.main(["--commit", "abc1234", "--records", str(path)]) == 0
  assert "the whole check passed at abc1234" in capsys.readouterr().out


def test_what_is_left_is_failed_or_missing_and_a_rerun_counts(steps, tmp_path, capsys):
  records = _records(steps, "abc1234", failed={"peer2", "fused"})
  records = [r for r in records if r["suite"] != "tests/test_nvshmem.py"]
  # A later passing run of a failed suite at the same commit replaces it.
  records += [dict(r, failed=0) for r in records
              if r["failed"] and r["suite"].startswith("tests/test_fused_expert_mlp.py")]
  path = tmp_path / "records.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  assert check_status.main(["--commit", "abc1234", "--records", str(path)]) == 1
  out = capsys.readouterr().out
  assert "peer2                  FAILED" in out and "nvshmem                missing" in out
  assert "fused                  passed" in out
  left = [line for line in out.splitlines() if line.startswith("left at")]
  assert left == ["left at abc1234: bash scripts/gpu_round.sh step:nvshmem step:peer2"]


def test_a_run_cut_by_its_time_limit_is_left_apart_from_failures(steps, tmp_path, capsys):
  """A suite stopped by its limit with no test failed (exit 124, one error for the cut) is
  `CUT`, not `FAILED`, and left to run; its time is a lower bound: the step counts as never
  timed (a call of its own) until a whole run took longer."""
  records = _records(steps, "abc1234")
  network2 = next(suites for _, step, suites in steps if step == "network2")
  cut = [dict(r, errors=1, exit_code=124, wall_s=290.0) for r in records
         if (r["suite"], r["ranks"], r["virtual_hosts"]) in network2]
  # A whole run of it elsewhere, shorter than the cut one; a failing run cut later is FAILED.
  earlier = [dict(r, commit="0ther00", errors=0, exit_code=0, wall_s=110.0) for r in cut]
  failing = [dict(r, failed=1, errors=1, exit_code=124, wall_s=290.0) for r in records
             if r["suite"] == "tests/test_nvshmem.py"]
  path = tmp_path / "records.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in earlier + records + cut + failing))
  assert check_status.main(["--commit", "abc1234", "--records", str(path)]) == 1
  out = capsys.readouterr().out
  assert "network2               CUT" in out and "nvshmem                FAILED" in out
  calls = [line for line in out.splitlines() if line.startswith("  one call")]
  assert any("step:network2  (never timed to its end: network2)" in c for c in calls), calls
  # Once a whole run took longer than the cut one, that is its time.
  longer = [dict(r, commit="0ther00", errors=0, exit_code=0, wall_s=300.0) for r in cut]
  path.write_text("".join(json.dumps(r) + "\n" for r in longer + records + cut))
  check_status.main(["--commit", "abc1234", "--records", str(path)])
  assert "one call, about 320 s: DEADLINE_S=580 bash scripts/gpu_round.sh step:network2\n" in (
      capsys.readouterr().out)


def test_a_suites_time_is_its_latest_passing_runs(steps, tmp_path, capsys):
  """The suites got faster (or slower) since an old run: the estimate is the latest whole
  passing run's time; a failing run, which may stop early, counts only without one."""
  nvshmem = [r for r in _records(steps, "0ther00") if r["suite"] == "tests/test_nvshmem.py"]
  old = [dict(r, exit_code=0, wall_s=430.0) for r in nvshmem]
  new = [dict(r, exit_code=0, wall_s=90.0) for r in nvshmem]
  failing = [dict(r, failed=1, exit_code=1, wall_s=500.0) for r in nvshmem]
  path = tmp_path / "records.jsonl"
  for history, want in ((old + new + failing, 110), (old + failing, 450), (failing, 520)):
    path.write_text("".join(json.dumps(r) + "\n" for r in history))
    check_status.main(["--commit", "abc1234", "--records", str(path)])
    calls = [line for line in capsys.readouterr().out.splitlines() if "step:nvshmem" in line]
    assert any(f"about {want} s" in c for c in calls), (want, calls)


def test_the_steps_left_are_packed_into_calls_by_their_measured_time():
  left = [("a", 200.0), ("b", 300.0), ("c", 100.0), ("d", None), ("e", 50.0)]
  assert check_status.pack(left, 560.0, start_s=20.0) == [
      (["a", "b"], 520), (["c"], 120), (["d"], 580), (["e"], 70)]
  assert check_status.pack(left, 560.0, start_s=20.0, unmeasured_s=150.0) == [
      (["a", "b"], 520), (["c", "d", "e"], 320)]


def test_a_commit_is_checked_against_its_own_steps(tmp_path):
  """The steps of a commit come from that commit's gpu_round.sh, not the working tree's."""
  import subprocess
  repo = tmp_path / "repo"
  subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
  script = repo / "scripts" / "gpu_round.sh"
  text = script.read_text()
  assert 'CHECK8="fused fused_wrapped"' in text
  script.write_text(text.replace('CHECK8="fused fused_wrapped"', 'CHECK8="fused"'))
  git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
  subprocess.run(git + ["commit", "-qam", "one step fewer"], check=True)
  (repo / "scripts" / "check_status.py").write_text(
      (ROOT / "scripts" / "check_status.py").read_text())  # this tree's, not the commit's
  run = [sys.executable, str(repo / "scripts" / "check_status.py"), "--records", os.devnull]
  before = subprocess.run(run + ["--commit", "HEAD~1"], capture_output=True, text=True).stdout
  after = subprocess.run(run + ["--commit", "HEAD"], capture_output=True, text=True).stdout
  assert "check8  fused_wrapped" in before and "fused_wrapped" not in after, (before, after)
