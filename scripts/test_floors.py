"""The CPU suite's floors: per test file, the least number of tests that must pass, and the
reasons a test may skip for. `.ci/run` checks every run against them, so a test that stops
being collected, or starts skipping for a reason nobody allowed, fails CI instead of lowering a
total quietly.

  python scripts/test_floors.py check JUNIT.xml [--extension yes|no]
  python scripts/test_floors.py update JUNIT.xml [JUNIT.xml ...]

`check` fails (exit 1) where a file passes fewer tests than its floor, a test file has no floor,
or a test skipped for a reason that matches no allowed pattern (the patterns under
`skips_without_extension` are allowed only where jax_ep's CUDA extension was not built).
`update` sets each file's floor to the fewest tests that passed in the reports given (the
runs with and without nvcc, say) and prints the skip reasons the patterns do not cover yet;
lowering a floor needs a reason in the commit message.

The floors live in .ci/test_floors.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

FLOORS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".ci",
                      "test_floors.json")


def read_report(path: str):
  """`(passed per file, [(file, test, skip reason)])` of a pytest junit report."""
  passed = collections.Counter()
  skips = []
  for case in ET.parse(path).getroot().iter("testcase"):
    module = case.get("classname", "").split(".")
    # classname is "tests.test_x" or "tests.test_x.TestClass".
    file = "/".join(module[:2]) + ".py" if len(module) >= 2 else case.get("file", "?")
    passed[file] += 0
    skipped = case.find("skipped")
    if skipped is not None:
      skips.append((file, case.get("name"), skipped.get("message", "")))
    elif case.find("failure") is None and case.find("error") is None:
      passed[file] += 1
  return passed, skips


def _allowed(reason: str, patterns) -> bool:
  return any(re.search(p, reason) for p in patterns)


def check(path: str, extension: bool, config: dict) -> list[str]:
  passed, skips = read_report(path)
  problems = []
  for file, floor in sorted(config["floors"].items()):
    if passed.get(file, 0) < floor:
      problems.append(f"{file}: {passed.get(file, 0)} passed, fewer than its floor of {floor}")
  for file in sorted(set(passed) - set(config["floors"])):
    problems.append(f"{file}: no floor in .ci/test_floors.json (add one: "
                    f"scripts/test_floors.py update)")
  patterns = list(config["skips"]) + ([] if extension else
                                      list(config["skips_without_extension"]))
  for file, test, reason in skips:
    if not _allowed(reason, patterns):
      problems.append(f"{file}::{test} skipped for a reason not allowed in "
                      f".ci/test_floors.json: {reason!r}")
  return problems


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("mode", choices=("check", "update"))
  parser.add_argument("reports", nargs="+")
  parser.add_argument("--extension", choices=("yes", "no"), default=None,
                      help="whether jax_ep's CUDA extension was built (default: ask jax_ep)")
  args = parser.parse_args(argv)
  with open(FLOORS) as f:
    config = json.load(f)
  if args.mode == "check":
    if args.extension is None:
      from jax_ep._native import ffi
      extension = ffi.extension() is not None
    else:
      extension = args.extension == "yes"
    problems = check(args.reports[0], extension, config)
    for p in problems:
      print(f"test floors: {p}", file=sys.stderr)
    total = sum(read_report(args.reports[0])[0].values())
    print(f"test floors: {total} passed over {len(config['floors'])} files; "
          f"{'ok' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0
  runs = [read_report(p) for p in args.reports]
  files = set().union(*(set(p) for p, _ in runs))
  config["floors"] = {f: min(p.get(f, 0) for p, _ in runs) for f in sorted(files)}
  with open(FLOORS, "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
  patterns = list(config["skips"]) + list(config["skips_without_extension"])
  uncovered = sorted({reason for _, skips in runs for _, _, reason in skips
                      if not _allowed(reason, patterns)})
  for reason in uncovered:
    print(f"not allowed yet: {reason!r}")
  print(f"floors of {len(files)} files written to {FLOORS}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
