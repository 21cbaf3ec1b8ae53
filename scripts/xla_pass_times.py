"""Where XLA's compile of a program goes, from its own timers in a log.

  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=2,gpu_compiler=1,nvptx_compiler=1 \
      python examples/moe_transformer.py --steps 1 2> compile.log
  python scripts/xla_pass_times.py compile.log [--module jit_train_step] [--top 15]

XLA logs a scoped timer for each HLO pass (`HLO pass: NAME time: ...`, hlo_pass_pipeline.cc at
verbosity 2), for its HLO passes and backend as a whole (`GpuCompiler::RunHloPasses`,
`GpuCompiler::RunBackend`, gpu_compiler.cc at 1) and for each PTX compile and ptxas run
(nvptx_compiler.cc at 1). This sums them per name for each compile (each ends with its
backend's timer) and prints the largest. A pass that compiles fusions on their own (XLA's
fusion autotuner, `config-assigner`) runs passes, PTX compiles and ptxas on them inside it:
those count under their own names too, so the rows overlap (and ptxas runs on several threads).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_PASS = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (s|ms|us) ")
_WHOLE = re.compile(r"(GpuCompiler::(?:RunHloPasses|RunBackend)|NVPTXCompiler::CompileTargetBinary"
                    r" - (?:CompileToPtx|PtxToCubin)) for (\S+) time: ([\d.]+) (s|ms|us) ")


def compiles(lines, module: str | None = None):
  """`[(module, {name: seconds})]`, one per compile (of `module` alone, if given): a compile's
  timers are those logged since the previous compile ended, and a compile ends with its
  backend's (`GpuCompiler::RunBackend for MODULE`). Without that timer in the log, the whole
  log is one compile."""
  out = []
  times = collections.Counter()
  for line in lines:
    found = _PASS.search(line)
    if found:
      times[found.group(1)] += float(found.group(2)) * _UNITS[found.group(3)]
      continue
    found = _WHOLE.search(line)
    if not found:
      continue
    times["[" + found.group(1) + "]"] += float(found.group(3)) * _UNITS[found.group(4)]
    if found.group(1) == "GpuCompiler::RunBackend":
      if module is None or found.group(2) == module:
        out.append((found.group(2), times))
      times = collections.Counter()
  if times and not out:
    out.append((module or "the log", times))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("log")
  parser.add_argument("--module", help="only this module's compiles (e.g. jit_step)")
  parser.add_argument("--top", type=int, default=15)
  args = parser.parse_args(argv)
  with open(args.log, errors="replace") as f:
    found = compiles(f, args.module)
  if not found:
    print(f"no XLA pass timers in {args.log}: set TF_CPP_MIN_LOG_LEVEL=0 and "
          "TF_CPP_VMODULE=hlo_pass_pipeline=2,gpu_compiler=1,nvptx_compiler=1", file=sys.stderr)
    return 1
  for i, (name, times) in enumerate(found):
    whole = {k: v for k, v in times.items() if k.startswith("[")}
    passes = collections.Counter({k: v for k, v in times.items() if not k.startswith("[")})
    print(f"compile {i} of {name}: " + ", ".join(f"{k[1:-1]} {v:.2f} s"
                                                 for k, v in sorted(whole.items())))
    for pass_name, seconds in passes.most_common(args.top):
      print(f"  {seconds:8.3f} s  {pass_name}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
