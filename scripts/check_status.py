"""Which parts of the GPU check (`bash scripts/gpu_round.sh check`) have passing records at a
commit, and which are left: a check may span several rounds and calls, as long as
every part runs at the same commit.

  python3 scripts/check_status.py [--commit C] [--records benchmarks/results/gpu_suites.jsonl]

The check's steps and the suites each runs come from gpu_round.sh itself (`CHECK_DRY_RUN=1`
prints each suite's gpu_suite.py command instead of running it); a suite's record is the one
whose `suite`, `ranks` and `virtual_hosts` gpu_suite.py would write for that command (the
last, where a suite ran more than once). The steps are those of the commit's own gpu_round.sh
(main may have moved on while its check runs). Prints each step as `passed`, `FAILED`, `CUT` or
`missing`, then the `step:...` arguments that run what is left (failed, cut or missing), packed
into calls of at most `--call-s` seconds by each suite's measured time (at any commit: its latest
whole passing run's, else its longest run's; a step never measured counts as a whole call, or
`--unmeasured-s`); exits 0 when nothing is. A run cut by its time limit (exit 124: the round's
deadline or the suite's own limit) with no test failed prints as `CUT`, not `FAILED`: it says
nothing of the product, and its time is only a lower bound, so a step cut after taking longer
than its estimate counts as never measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import gpu_suite  # noqa: E402


def _dry_run(tree: str) -> str:
  """What `tree`'s gpu_round.sh prints for the whole check with `CHECK_DRY_RUN=1`."""
  return subprocess.run(["bash", os.path.join(tree, "scripts", "gpu_round.sh"), "check"],
                        env=dict(os.environ, CHECK_DRY_RUN="1", OUT=os.devnull), cwd=tree,
                        capture_output=True, text=True, check=True).stdout


def check_steps(commit: str | None = None
                ) -> list[tuple[str, str, list[tuple[str, int, int | None]]]]:
  """`(part, step, [(suite, ranks, virtual_hosts), ...])` of every step of the check, in order,
  from the dry run of `commit`'s gpu_round.sh (None: the working tree's)."""
  if commit is None:
    out = _dry_run(REPO)
  else:
    with tempfile.TemporaryDirectory() as tree:
      archive = subprocess.run(["git", "archive", commit, "scripts"], cwd=REPO,
                               capture_output=True, check=True).stdout
      subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
      out = _dry_run(tree)
  steps = []
  for line in out.splitlines():
    if line.startswith("=== check"):
      part, step = line[len("=== "):].split(" (")[0].split(": ")
      steps.append((part, step, []))
    elif line.startswith("SUITE "):
      args, command = gpu_suite.parse_args(shlex.split(line[len("SUITE "):]))
      steps[-1][2].append((gpu_suite.suite_name(args, command), args.ranks,
                           args.virtual_hosts))
  return steps


def _cut(record: dict) -> bool:
  """A run stopped by its time limit before any test of it failed."""
  return record.get("exit_code") == 124 and record["failed"] == 0


def status(records: list[dict], commit: str, script_commit: str | None = None):
  """`[(part, step, state)]` with state "passed", "FAILED", "CUT" or "missing"; the steps
  left, each with its suites' measured seconds (the latest whole passing run's, else the
  longest run's; None where a run cut since took longer)."""
  last, passing, longest, cut_at = {}, {}, {}, {}
  for r in records:
    if r.get("op") != "gpu_suite":
      continue
    key = (r["suite"], r["ranks"], r.get("virtual_hosts"))
    t = r.get("wall_s")
    if t is not None:
      if _cut(r):
        cut_at[key] = max(cut_at.get(key, 0.0), t)
      elif r["failed"] == 0 and r["errors"] == 0 and r.get("exit_code", 0) == 0:
        # The latest whole passing run: the suite's length now (tests and the code they run
        # change its time), and a cut before it said nothing of that.
        passing[key] = t
        cut_at.pop(key, None)
      else:
        longest[key] = max(longest.get(key, 0.0), t)  # a failing run may stop early
  seconds = {**longest, **passing}
  for r in records:
    if r.get("op") == "gpu_suite" and r.get("commit") == commit:
      last[(r["suite"], r["ranks"], r.get("virtual_hosts"))] = r
  for key, t in cut_at.items():
    if seconds.get(key, 0.0) < t:
      seconds.pop(key, None)  # took longer than its estimate: no estimate
  rows, left = [], []
  for part, step, suites in check_steps(script_commit):
    found = [last.get(s) for s in suites]
    if any(r is None for r in found):
      state = "missing"
    elif all(r["failed"] == 0 and r["errors"] == 0 for r in found):
      state = "passed"
    elif all(r["failed"] == 0 and (r["errors"] == 0 or _cut(r)) for r in found):
      state = "CUT"
    else:
      state = "FAILED"
    rows.append((part, step, state))
    if state != "passed":
      times = [seconds.get(s) for s in suites]
      left.append((step, None if None in times else sum(times)))
  return rows, left


def pack(left, call_s: float, start_s: float = 20.0, unmeasured_s: float | None = None):
  """The steps left in calls of at most `call_s` seconds, in the check's order: `[([steps],
  estimated seconds)]`, each call `start_s` for the round's start besides its steps; a step
  never timed counts `unmeasured_s` (None: a whole call)."""
  calls = []
  for step, t in left:
    t = (call_s if unmeasured_s is None else unmeasured_s) if t is None else t
    if calls and calls[-1][1] + t <= call_s:
      calls[-1][0].append(step)
      calls[-1][1] += t
    else:
      calls.append([[step], start_s + t])
  return [(steps, round(t)) for steps, t in calls]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--commit", default="HEAD", help="default: HEAD")
  parser.add_argument("--records", default=os.path.join(REPO, "benchmarks", "results",
                                                        "gpu_suites.jsonl"))
  parser.add_argument("--call-s", type=float, default=560.0,
                      help="the most seconds one call's steps may take (default 560)")
  parser.add_argument("--unmeasured-s", type=float, default=None,
                      help="seconds to count for a step never timed (default: a whole call); "
                           "the round's deadline skips a step that would start too late")
  args = parser.parse_args(argv)
  found = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=REPO,
                         capture_output=True, text=True)
  if found.returncode == 0:
    commit = script_commit = found.stdout.strip()
  else:  # a commit this clone lacks: its records against the working tree's steps
    commit, script_commit = args.commit, None
    print(f"{commit} is not in this clone: the working tree's check steps")
  with open(args.records) as f:
    records = [json.loads(line) for line in f if line.strip()]
  rows, left = status(records, commit, script_commit)
  for part, step, state in rows:
    print(f"{part:7s} {step:22s} {state}")
  if left:
    print(f"left at {commit}: bash scripts/gpu_round.sh "
          + " ".join(f"step:{s}" for s, _ in left))
    never = {s for s, t in left if t is None}
    for steps, t in pack(left, args.call_s, unmeasured_s=args.unmeasured_s):
      print(f"  one call, about {t} s: DEADLINE_S={int(args.call_s) + 20} bash "
            "scripts/gpu_round.sh " + " ".join(f"step:{s}" for s in steps)
            + (f"  (never timed to its end: {' '.join(sorted(never & set(steps)))})"
               if never & set(steps) else ""))
    return 1
  print(f"the whole check passed at {commit}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
