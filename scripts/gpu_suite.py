"""Runs one GPU suite and records its result: one `gpu_suite` line of JSON per run.

  python3 scripts/gpu_suite.py [--ranks N] [--virtual-hosts K] [--sanitizer TOOL]
      [--kernels NAME ...] [--timeout S] [--out DIR] [--name NAME] -- COMMAND ...

COMMAND is a pytest run (`python3 -m pytest tests/... -q`) or any program (exit status 0
passes). With `--ranks N` it runs under `jax_ep.launch -n N --share-gpu` (N processes, one EP
rank each, sharing GPU 0 under CUDA MPS), with `--virtual-hosts K` as K virtual hosts (the
network transport), with `--sanitizer memcheck|racecheck` inside compute-sanitizer (each
process; `--kernels` filters the kernels it instruments).

Every process of a pytest run writes its own junit report (tests/conftest.py reads
JAX_EP_JUNIT_PREFIX); the record counts tests over the ranks: `passed` and `skipped` as rank 0
saw them, `failed` the most any rank saw (plus compute-sanitizer's errors), `errors` the most
collection or set-up errors any rank saw plus one for each rank that wrote no report or a run
that exited non-zero without a failure to show for it; `slowest_tests` names rank 0's five
longest tests with their seconds. The run sets JAX_EP_REQUIRE_GPU=1:
a test that would skip for a missing GPU, extension, NVSHMEM module or Hopper chip fails.

The record goes to DIR/gpu_suites.jsonl (DIR: --out, else $OUT, else gpu_out), the output to
DIR/logs/NAME.log. Exits 0 exactly when the suite passed (no failure, no error).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_junit(path: str) -> dict[str, int]:
  """Test counts of one junit report (pytest's `--junitxml`)."""
  counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
  for case in ET.parse(path).getroot().iter("testcase"):
    if not case.get("name"):
      continue  # the test a run was interrupted in (counted as the run's timeout)
    if case.find("error") is not None:
      counts["errors"] += 1
    elif case.find("failure") is not None:
      counts["failed"] += 1
    elif case.find("skipped") is not None:
      counts["skipped"] += 1
    else:
      counts["passed"] += 1
  return counts


def slowest_tests(path: str, count: int = 5) -> list[list]:
  """The `count` longest tests of one junit report, `[[name, seconds], ...]`, longest first:
  where a suite's time goes (most of it compilation, on the GPU machine's CPU)."""
  cases = [(case.get("name"), float(case.get("time") or 0.0))
           for case in ET.parse(path).getroot().iter("testcase") if case.get("name")]
  return [[name, round(t, 1)] for name, t in sorted(cases, key=lambda c: -c[1])[:count]]


def sanitizer_errors(log: str) -> int | None:
  """The errors compute-sanitizer reported over every process of `log` (its "ERROR SUMMARY:
  N errors" lines; racecheck's hazards count as errors too), None where it printed none."""
  found = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", log)]
  found += [int(n) for n in re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error",
                                       log)]
  return sum(found) if found else None


def combine(per_rank: list[dict[str, int] | None], ranks: int) -> dict[str, int]:
  """One count for the suite out of each rank's (None: the rank wrote no report)."""
  reports = [r for r in per_rank if r is not None]
  if not reports:
    return {"passed": 0, "failed": 0, "skipped": 0, "errors": ranks}
  return {"passed": reports[0]["passed"], "skipped": reports[0]["skipped"],
          "failed": max(r["failed"] for r in reports),
          "errors": max(r["errors"] for r in reports) + (ranks - len(reports))}


def _commit() -> str:
  if os.environ.get("JAX_EP_COMMIT"):
    return os.environ["JAX_EP_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def _gpu() -> str:
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout
    return out.strip().splitlines()[0]
  except (OSError, subprocess.SubprocessError, IndexError):
    return "unknown"


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
  """`(options, the suite's command)` of a gpu_suite.py command line."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ranks", type=int, default=1)
  parser.add_argument("--virtual-hosts", type=int, default=None)
  parser.add_argument("--sanitizer", choices=("memcheck", "racecheck"), default=None)
  parser.add_argument("--kernels", nargs="*", default=[],
                      help="compute-sanitizer --kernel-name filters (e.g. kns=jax_ep)")
  parser.add_argument("--timeout", type=float, default=540.0)
  parser.add_argument("--max-seconds", type=float, default=None,
                      help="a cap on --timeout (the time left of a round)")
  parser.add_argument("--no-share-gpu", dest="share_gpu", action="store_false",
                      help="launch the ranks without --share-gpu (a CPU trial of this script)")
  parser.add_argument("--out", default=None)
  parser.add_argument("--name", default=None, help="the run's name (default: from the command)")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if args.max_seconds is not None:
    args.timeout = min(args.timeout, args.max_seconds)
  if not command:
    parser.error("give the suite's command after --")
  return args, command


def suite_name(args: argparse.Namespace, command: list[str]) -> str:
  """The record's `suite`: the files the command runs, its `-m` / `-k` selection, and the
  sanitizer (`memcheck:...`)."""
  pytest_run = "pytest" in command
  targets = [c for c in command if c.startswith("tests/") or c.startswith("scripts/")]
  suite = " ".join(targets) or " ".join(command)
  options = command[command.index("pytest") + 1:] if pytest_run else []
  for flag in ("-m", "-k"):  # a selection is part of the suite's name
    if flag in options:
      value = options[options.index(flag) + 1]
      suite += f" {flag} {value!r}" if " " in value else f" {flag} {value}"
  if args.sanitizer:
    suite = f"{args.sanitizer}:{suite}"
  return suite


def main(argv=None) -> int:
  args, command = parse_args(argv)
  out = args.out or os.environ.get("OUT") or "gpu_out"
  pytest_run = "pytest" in command
  suite = suite_name(args, command)
  name = args.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{suite}_r{args.ranks}"
                             f"{'_v' + str(args.virtual_hosts) if args.virtual_hosts else ''}")
  name = name.strip("_")[:120]
  junit_dir = os.path.join(out, "junit")
  os.makedirs(junit_dir, exist_ok=True)
  os.makedirs(os.path.join(out, "logs"), exist_ok=True)
  for stale in glob.glob(os.path.join(junit_dir, f"{name}.p*.xml")):
    os.remove(stale)

  env = dict(os.environ, JAX_EP_REQUIRE_GPU="1", PYTHONUNBUFFERED="1",
             JAX_EP_JUNIT_PREFIX=os.path.join(os.path.abspath(junit_dir), name))
  env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  if args.virtual_hosts:
    env["JAX_EP_VIRTUAL_HOSTS"] = str(args.virtual_hosts)
  inner = list(command)
  if args.sanitizer:
    filters = [a for k in args.kernels for a in ("--kernel-name", k)]
    inner = ["compute-sanitizer", "--tool", args.sanitizer, *filters, "--print-limit", "20",
             *inner]
  full = inner
  if args.ranks > 1:
    full = [sys.executable, "-m", "jax_ep.launch", "-n", str(args.ranks),
            *(["--share-gpu"] if args.share_gpu else []), "--grace", "20",
            "--timeout", str(max(args.timeout - 15, 30)), "--", *inner]
  print(f"=== {suite} (R={args.ranks}"
        f"{f', {args.virtual_hosts} virtual hosts' if args.virtual_hosts else ''}) "
        f"{time.strftime('%H:%M:%S')}", flush=True)
  start = time.monotonic()
  log_path = os.path.join(out, "logs", f"{name}.log")
  with open(log_path, "w") as log_file:
    # A process group of its own, so that a run past its time goes with everything it started.
    try:
      proc = subprocess.Popen(full, cwd=REPO, env=env, stdout=log_file,
                              stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:  # e.g. compute-sanitizer not installed
      log_file.write(f"gpu_suite.py: cannot start {full[0]}: {e}\n")
      proc = None
      code = 127
    if proc is not None:
      # Past its time the run is interrupted first (SIGINT: pytest stops at the running test,
      # prints its summary and writes its junit report), killed after a grace.
      grace = min(30.0, args.timeout / 10)
      try:
        code = proc.wait(timeout=args.timeout - grace)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
          proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
          os.killpg(proc.pid, signal.SIGKILL)
          proc.wait()
        code = 124
  wall = time.monotonic() - start
  log = open(log_path).read()

  if pytest_run:
    reports = {int(m.group(1)): path for path in glob.glob(os.path.join(junit_dir,
                                                                          f"{name}.p*.xml"))
               if (m := re.search(r"\.p(\d+)\.xml$", path))}
    per_rank = []
    for rank in range(args.ranks):
      try:
        per_rank.append(parse_junit(reports[rank]) if rank in reports else None)
      except ET.ParseError:
        per_rank.append(None)
    counts = combine(per_rank, args.ranks)
    try:
      slowest = slowest_tests(reports[0]) if 0 in reports else []
    except ET.ParseError:
      slowest = []
  else:
    counts = {"passed": int(code == 0), "failed": int(code != 0), "skipped": 0, "errors": 0}
    slowest = []
  found = sanitizer_errors(log) if args.sanitizer else 0
  if args.sanitizer and found is None:
    counts["errors"] += 1  # the tool printed no summary: it did not run to the end
  counts["failed"] += found or 0
  if code == 124:
    counts["errors"] += 1  # cut by its time limit: the tests it did not reach are not counted
  elif code != 0 and counts["failed"] == 0 and counts["errors"] == 0:
    counts["errors"] = 1  # exited non-zero (a crash, no tests) with nothing to show
  if pytest_run and sum(counts.values()) == 0:
    counts["errors"] = 1  # collected nothing
  record = {"op": "gpu_suite", "suite": suite, "ranks": args.ranks,
            "process_model": ("single_device" if args.ranks == 1 else
                              "shared_gpu" if args.share_gpu else "process_per_gpu"),
            "virtual_hosts": args.virtual_hosts, **counts, "exit_code": code,
            "wall_s": round(wall, 1), "slowest_tests": slowest, "gpu": _gpu(),
            "date": datetime.date.today().isoformat(), "commit": _commit()}
  if args.ranks > 1 and os.environ.get("JAX_EP_TEST_SHARED_COMPILE") == "1":
    record["shared_compile"] = True  # tests/conftest.py: one process compiles, the rest load
  with open(os.path.join(out, "gpu_suites.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\n")
  ok = counts["failed"] == 0 and counts["errors"] == 0
  summary = [line for line in log.splitlines()
             if re.search(r"(^|\] )(FAILED|ERROR) |ERROR SUMMARY|RACECHECK SUMMARY| passed| failed",
                          line)]
  print("\n".join(summary[-12:]))
  print(f"{'PASS' if ok else 'FAIL'} {suite} R={args.ranks}: {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped, {counts['errors']} errors "
        f"(exit {code}, {wall:.0f} s; log {log_path})", flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
