"""Which parts of the GPU check (`bash scripts/gpu_round.sh check`) have passing records at a
commit, and which are left: a check may span several rounds and calls, as long as
every part runs at the same commit.

  python3 scripts/check_status.py [--commit C] [--records benchmarks/results/gpu_suites.jsonl]

The check's steps and the suites each runs come from gpu_round.sh itself (`CHECK_DRY_RUN=1`
prints each suite's gpu_suite.py command instead of running it); a suite's record is the one
whose `suite`, `ranks` and `virtual_hosts` gpu_suite.py would write for that command (the
last, where a suite ran more than once). Prints each step as `passed`, `FAILED` or `missing`,
then the `step:...` arguments that run what is left (failed or missing); exits 0 when nothing
is.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import gpu_suite  # noqa: E402


def check_steps() -> list[tuple[str, str, list[tuple[str, int, int | None]]]]:
  """`(part, step, [(suite, ranks, virtual_hosts), ...])` of every step of the check, in order,
  from gpu_round.sh's dry run."""
  out = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_round.sh"), "check"],
                       env=dict(os.environ, CHECK_DRY_RUN="1", OUT=os.devnull), cwd=REPO,
                       capture_output=True, text=True, check=True).stdout
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


def status(records: list[dict], commit: str):
  """`[(part, step, state)]` with state "passed", "FAILED" or "missing", and the steps left."""
  last = {}
  for r in records:
    if r.get("op") == "gpu_suite" and r.get("commit") == commit:
      last[(r["suite"], r["ranks"], r.get("virtual_hosts"))] = r
  rows, left = [], []
  for part, step, suites in check_steps():
    found = [last.get(s) for s in suites]
    if any(r is None for r in found):
      state = "missing"
    elif all(r["failed"] == 0 and r["errors"] == 0 for r in found):
      state = "passed"
    else:
      state = "FAILED"
    rows.append((part, step, state))
    if state != "passed":
      left.append(step)
  return rows, left


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--commit", default=None, help="default: HEAD's short hash")
  parser.add_argument("--records", default=os.path.join(REPO, "benchmarks", "results",
                                                        "gpu_suites.jsonl"))
  args = parser.parse_args(argv)
  commit = args.commit or subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
      check=True).stdout.strip()
  with open(args.records) as f:
    records = [json.loads(line) for line in f if line.strip()]
  rows, left = status(records, commit)
  for part, step, state in rows:
    print(f"{part:7s} {step:22s} {state}")
  if left:
    print(f"left at {commit}: bash scripts/gpu_round.sh " + " ".join(f"step:{s}" for s in left))
    return 1
  print(f"the whole check passed at {commit}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
