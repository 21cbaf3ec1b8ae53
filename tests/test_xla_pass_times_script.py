"""scripts/xla_pass_times.py reads XLA's compile timers from a log: each compile's passes
summed by name, a compile ending with its backend's timer, one module's compiles alone."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("xla_pass_times",
                                               ROOT / "scripts" / "xla_pass_times.py")
xla_pass_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(xla_pass_times)

PREFIX = "I1206 13:08:52.743882   17228 "
LOG = [PREFIX + line for line in """\
hlo_pass_pipeline.cc:302] Running HLO pass pipeline on module jit_step: simplification
hlo_pass_pipeline.cc:206] HLO pass: algsimp time: 2.5 ms (2500 us) (cumulative: 2.5 ms)
hlo_pass_pipeline.cc:206] HLO pass: algsimp time: 500 us (500 us) (cumulative: 3 ms)
hlo_pass_pipeline.cc:206] HLO pass: config-assigner time: 4.66 s (4664665 us) (cumulative: 5 s)
gpu_compiler.cc:2345] GpuCompiler::RunHloPasses for jit_step time: 5 s (5000000 us) (x)
nvptx_compiler.cc:6] NVPTXCompiler::CompileTargetBinary - PtxToCubin for jit_step time: 26.4 ms (x)
ir.cc:2] GpuCompiler::RunBackend - IR emission for loop.1 time: 97.9 ms (x)
gpu_compiler.cc:2400] GpuCompiler::RunBackend for jit_step time: 2 s (2000000 us) (x)
hlo_pass_pipeline.cc:206] HLO pass: algsimp time: 1 ms (1000 us) (cumulative: 1 ms)
gpu_compiler.cc:2400] GpuCompiler::RunBackend for jit_eval time: 1 s (1000000 us) (x)
""".splitlines()]


def test_each_compile_sums_its_passes_and_ends_with_its_backend():
  found = xla_pass_times.compiles(LOG)
  assert [name for name, _ in found] == ["jit_step", "jit_eval"]
  step = found[0][1]
  assert abs(step["algsimp"] - 3e-3) < 1e-12
  assert abs(step["config-assigner"] - 4.66) < 1e-12
  assert step["[GpuCompiler::RunHloPasses]"] == 5.0
  assert step["[GpuCompiler::RunBackend]"] == 2.0
  assert abs(step["[NVPTXCompiler::CompileTargetBinary - PtxToCubin]"] - 26.4e-3) < 1e-12
  # An IR emission's timer is not the backend's end.
  assert not any("IR emission" in key for key in step)
  assert abs(found[1][1]["algsimp"] - 1e-3) < 1e-12


def test_one_module_alone_and_a_log_without_backend_timers(tmp_path):
  assert [name for name, _ in xla_pass_times.compiles(LOG, "jit_eval")] == ["jit_eval"]
  (name, times), = xla_pass_times.compiles(LOG[:4])
  assert name == "the log" and abs(times["config-assigner"] - 4.66) < 1e-12
  log = tmp_path / "compile.log"
  log.write_text("\n".join(LOG) + "\n")
  assert xla_pass_times.main([str(log), "--module", "jit_step"]) == 0
  log.write_text("a log without XLA's timers\n")
  assert xla_pass_times.main([str(log)]) == 1
