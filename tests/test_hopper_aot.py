"""jax_ep's programs compiled for an H200 on a machine without a GPU (`jax_ep.testing.aot`):
XLA's GPU compiler and the Mosaic GPU kernels through ptxas for sm_90a, nothing run.

Each case runs in a process of its own (tests/hopper_aot_cases.py) that sees JAX's CUDA PJRT
plugin, installed apart from the environment (scripts/setup.sh: `.venv/cuda-aot` with the CUDA
build; `JAX_EP_AOT_PLUGIN_PATH` names another folder). What it checks is what a GPU run cannot
show as directly: which kernel every model shape takes and that each builds without spilling,
that the ops on `comm_stream` run in XLA's async calls, that XLA keeps one call per op, and
where XLA puts the ops on jax_ep's own stream and their joins.
Whether the kernels compute the right numbers is for the GPU suites.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from jax_ep._native import ffi
from jax_ep.experts import configs
from test_fused_expert_mlp import GPU_SHAPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.environ.get("JAX_EP_AOT_PLUGIN_PATH", os.path.join(ROOT, ".venv", "cuda-aot"))
CASES = os.path.join(ROOT, "tests", "hopper_aot_cases.py")
SHAPES = sorted(GPU_SHAPES)  # the five model shapes of the GPU tests

pytestmark = [
    pytest.mark.skipif(
        not os.path.isdir(os.path.join(PLUGIN, "jax_plugins", "xla_cuda13")),
        reason="needs the built extension's companion for compiling without a GPU, JAX's CUDA "
               "PJRT plugin (scripts/setup.sh installs it into .venv/cuda-aot for CUDA builds)"),
    pytest.mark.skipif(shutil.which("ptxas") is None,
                       reason="needs the built extension's toolkit: ptxas on PATH"),
]
needs_extension = pytest.mark.skipif(
    ffi.extension() is None, reason="needs the built extension (the ops' FFI handlers)")


def _run(case: str, arg: str | None = None, timeout: int = 900, ptxas: bool = True):
  """(the case's result, its whole output) from a process that sees the plugin; ptxas's
  reports in the output with `ptxas` (`MOSAIC_GPU_DUMP_PTXAS`, a dump variable: jax_ep's
  kernels then keep the modules Mosaic GPU makes, `compile_ahead.stable_modules`)."""
  path = [PLUGIN, ROOT, os.environ.get("PYTHONPATH", "")]
  env = {k: v for k, v in os.environ.items() if k != "MOSAIC_GPU_DUMP_PTXAS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in path if p),
             **({"MOSAIC_GPU_DUMP_PTXAS": "1"} if ptxas else {}))
  proc = subprocess.run([sys.executable, CASES, case] + ([arg] if arg else []), env=env,
                        capture_output=True, text=True, timeout=timeout)
  output = proc.stdout + proc.stderr
  results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  assert proc.returncode == 0 and results, f"{case} {arg}: exit {proc.returncode}\n{output[-6000:]}"
  return json.loads(results[-1][len("RESULT "):]), output


def _ptxas_reports(output: str) -> list[dict]:
  """ptxas's report of each kernel it compiled: name, registers, spill stores and loads."""
  reports = []
  for block in output.split("Compiling entry function '")[1:]:
    name = block.split("'", 1)[0].removesuffix("_mosaic_gpu_kernel")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
    regs = re.search(r"Used (\d+) registers", block)
    if spills and regs:
      reports.append({"kernel": name, "registers": int(regs.group(1)),
                      "spill_stores": int(spills.group(1)), "spill_loads": int(spills.group(2))})
  return reports


# Kernels that spill, and the most bytes they may, at a model shape (one rank of DeepSeek-V3
# at EP=8; the five shapes gave the same; docs/dev/notes.md): the FP8 gated projections'
# warp-specialized form, two accumulators and two fp32 totals within 168 registers. Any other
# spill, or a larger one, fails.
KNOWN_SPILLS = {"jax_ep_fp8_gate_up_ws": 40}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_model_shapes_take_the_mosaic_kernels(shape):
  """At each model shape every expert product takes jax_ep's Mosaic GPU kernels, bf16 and FP8,
  forward and backward, and each of their builds is a known one: the choice compiled nothing
  (no probe: no ptxas report), so a first step compiles each kernel once."""
  result, output = _run("kernels", shape)
  for name in ("gate_up", "down", "fp8_gate_up", "fp8_down"):
    assert result[name][0] == "mosaic", (name, result[name])
  for name in ("fused_mlp", "fp8_mlp"):
    assert result[name][0] == "True", (name, result[name])
  assert not _ptxas_reports(output), _ptxas_reports(output)


def _check_spills(output: str):
  """No kernel ptxas compiled in `output` spills beyond `KNOWN_SPILLS`."""
  reports = _ptxas_reports(output)
  assert reports, output[-4000:]
  spilled = [r for r in reports if r["spill_stores"] or r["spill_loads"]]
  unexpected = [r for r in spilled
                if max(r["spill_stores"], r["spill_loads"]) > KNOWN_SPILLS.get(r["kernel"], 0)]
  assert not unexpected, (unexpected, spilled)


def _check_builds(which: str, kernels: set):
  """Every known build of `which` kind compiles (its spills, which the small sizes here change,
  are checked at a model shape: the layer's test)."""
  result, output = _run("known_builds", which)
  failed = {build: why for build, why in result.items() if why is not None}
  assert result and not failed, failed
  names = {r["kernel"] for r in _ptxas_reports(output)}
  assert kernels <= names, (sorted(kernels - names), sorted(names))


@pytest.mark.slow
def test_every_known_bf16_build_builds_for_sm90a():
  """`builds.KNOWN_BUILDS` (the builds the kernel choice takes without its compile probe) of
  the grouped GEMM and the fused MLP, every activation, each compiled through ptxas for
  sm_90a: none fails."""
  _check_builds("bf16", {"jax_ep_gmm", "jax_ep_gmm_ws", "jax_ep_gmm_wgrad", "jax_ep_gmm_wgrad_ws",
                         "jax_ep_mlp_gate_up_ws", "jax_ep_mlp_hidden_grad_ws",
                         "jax_ep_mlp_input_grad"})


@pytest.mark.slow
def test_the_weight_grad_with_two_compute_warpgroups_builds_for_sm90a():
  """The weight gradient's two compute warpgroups that the tune times (2 and 3 stages, the rows
  in place and aligned copies) build at one rank of DeepSeek-V3 at EP=8 through ptxas, none
  spilling."""
  result, output = _run("weight_grad_wgs")
  failed = {tiles: why for tiles, why in result.items() if why is not None}
  assert len(result) == 4 and not failed, failed
  reports = [r for r in _ptxas_reports(output) if r["kernel"] == "jax_ep_gmm_wgrad_ws"]
  assert len(reports) == len(result), reports
  assert not any(r["spill_stores"] or r["spill_loads"] for r in reports), reports


@pytest.mark.slow
def test_the_specialized_fused_kernels_build_for_sm90a():
  """The fused MLP's warp-specialized gated projections and hidden gradient (two compute
  warpgroups, 4 stages: the most shared memory the tune tries) build in the MLP's forward
  and backward at one rank of DeepSeek-V3 at EP=8 through ptxas, gated and plain
  activations, none spilling."""
  result, output = _run("specialized_fused")
  failed = {case: why for case, why in result.items() if why is not None}
  assert len(result) == 2 and not failed, failed
  for name in ("jax_ep_mlp_gate_up_ws", "jax_ep_mlp_hidden_grad_ws"):
    # Each activation's kernel at least once (the choice's probe builds the gated projections
    # again: the forward alone saves no projections).
    reports = [r for r in _ptxas_reports(output) if r["kernel"] == name]
    assert len(reports) >= len(result), (name, reports)
    assert not any(r["spill_stores"] or r["spill_loads"] for r in reports), reports


def test_the_dequantize_kernel_builds_for_sm90a():
  """`jax_ep.dequantize` of the rows inside the groups compiles for the H200 under vmap and
  grad, and the program calls jax_ep's kernel (not XLA's pass over every row)."""
  result, _ = _run("dequantize_rows", ptxas=False)
  assert result == {"kernel": True}, result


@pytest.mark.slow
def test_the_weight_grad_runs_the_tune_tries_build_for_sm90a():
  """Every weight-gradient pipeline through runs of groups that the tune times (the rows in
  place and aligned copies) builds at DeepSeek-V3's shape through ptxas, none spilling: a tune
  on the GPU spends no time on one that cannot run."""
  result, output = _run("weight_grad_runs")
  failed = {tiles: why for tiles, why in result.items() if why is not None}
  assert len(result) == 2 * len(configs.weight_grad_run_tiles()) and not failed, failed
  reports = [r for r in _ptxas_reports(output) if r["kernel"] == "jax_ep_gmm_wgrad_runs"]
  assert len(reports) == len(result), reports
  assert not any(r["spill_stores"] or r["spill_loads"] for r in reports), reports


@pytest.mark.slow
def test_every_known_fp8_build_builds_for_sm90a():
  """The FP8 product and MLP builds of `builds.KNOWN_BUILDS`, every activation, as above."""
  _check_builds("fp8", {"jax_ep_fp8_gmm_ws", "jax_ep_fp8_gate_up_ws", "jax_ep_fp8_wgrad_ws"})


@pytest.mark.slow
def test_calls_on_weights_quantised_once_share_their_transposes():
  """Four FP8 calls on one set of `Fp8Weights` (a step's micro-batches): XLA writes the
  backward's e4m3 copies of the weights (`[w_gate | w_up]` and `w_down` in the layouts the input
  and hidden gradients read) once for all four, as for one call, while every call runs its own
  kernels: what makes quantising once a step take the weights' fixed cost off each call."""
  result, _ = _run("shared_weights")
  one, four = result["1"], result["4"]
  assert one["weights_written"] == ["f8e4m3fn[8,1024,1024]", "f8e4m3fn[8,512,1024]"], one
  assert four["weights_written"] == one["weights_written"], four
  assert four["mosaic"] == 4 * one["mosaic"] > 0, result


@needs_extension
def test_each_op_is_one_call_and_on_its_stream_in_the_compiled_program():
  """tests/test_comm_stream.py's programs (one rank, the peer transport, the FP8 dispatch, the
  network transport's rail exchange; jit, grad, checkpoint, vmap, scan, and the gradient of a
  scan of checkpointed layers) compiled for the H200: with `comm_stream=1` every jax_ep custom
  call sits in an async call's body (XLA's wrapper of an annotated op: the op runs on the
  stream), without it none does (nor on jax_ep's own stream, whose ops XLA sees as its own);
  and XLA keeps as many calls of each op and join as the lowered program makes (its
  dynamic-slice fusion copied a peer op under vmap, and under a scan whose residuals are the
  op's or the join's results, so that it ran twice: streams.unfused)."""
  result, _ = _run("streams")
  assert len(result) == 4 * 6 * 3
  for key, found in result.items():
    stream = key.rsplit("/", 1)[1]
    compiled = {target: len(homes) for target, homes in found["compiled"].items()}
    assert compiled == found["lowered"], (key, found)
    homes = [home for homes in found["compiled"].values() for home in homes]
    assert homes and all(homes) if stream == "1" else not any(homes), (key, found)


@needs_extension
@pytest.mark.slow
def test_two_micro_batches_put_communication_beside_the_experts():
  """The layer at one rank with `comm_stream=1` and two micro-batches, forward and backward, as
  XLA schedules it for the H200: on a model of the two streams (hopper_aot_cases.overlap: a
  start waits for the compute stream's earlier work, a done makes it wait for the op) part of
  the dispatches' and combines' time runs beside the expert kernels. What XLA makes of it: a
  compiled program that serialises every op again would hide nothing."""
  result, _ = _run("schedule")
  kinds = [kind for kind, _, _ in result["order"]]
  assert kinds.count("kernel") >= 8 and kinds.count("start") >= 8, result["order"]
  for comm, found in result["overlap"].items():
    assert found["hidden"] > 0.2, (comm, found, result["order"])


@needs_extension
@pytest.mark.slow
@pytest.mark.parametrize("passes", ["forward", "forward_backward"])
def test_own_stream_pipeline_hides_half_the_communication(passes):
  """The same layer with `comm_stream="jax_ep"` (jax_ep's pipeline, jax_ep/overlap.py), as XLA
  schedules it for the H200: on the same model (an op on the own stream waits for the compute
  stream's earlier work, a join for the latest op of its key) the second micro-batch's dispatch
  runs beside the first's experts and the first's combine beside the second's, in the forward
  and in the backward: half the communication, all a two-stage pipeline can hide. No join
  reads a copy of an op's result, and no op a copy of its operand."""
  result, _ = _run("schedule", "forward,own" if passes == "forward" else "own")
  kinds = [kind for kind, _, _ in result["order"]]
  assert kinds.count("kernel") >= 4 and kinds.count("start") >= 6, result["order"]
  for comm, found in result["overlap"].items():
    assert found["hidden"] >= 0.45, (comm, found, result["order"])
  assert result["copied_into_joins"] == [], result["copied_into_joins"]


@needs_extension
@pytest.mark.slow
def test_the_layer_runs_every_expert_product_in_the_mosaic_kernels():
  """`jax_ep.moe_mlp` at one rank on the cuda backend, forward and backward, compiled for the
  H200 as users call it: bf16 runs 7 Mosaic GPU kernels (the fused gate and up, the down
  projection; the hidden and input gradients, three weight gradients), FP8 with `remat` and two
  micro-batches 16 (per micro-batch the forward's two, their recomputation and the backward's
  four: the hidden and input gradients, two FP8 weight gradients) and the FP8 dispatch; a
  product that fell back to XLA would lower the count. ptxas spills in none of
  the kernels beyond `KNOWN_SPILLS`."""
  result, output = _run("layer")
  _check_spills(output)
  assert result["bf16"]["mosaic"] == 7, result
  assert result["fp8_remat_mb2"]["mosaic"] == 16, result
  own = result["fp8_remat_mb2_own_stream"]["jax_ep"]
  assert result["fp8_remat_mb2_own_stream"]["mosaic"] == 16, result
  assert "jax_ep_local_dispatch_fp8_own_stream" in own and "jax_ep_join" in own, result
  assert "jax_ep_local_dispatch_fp8" in result["fp8_remat_mb2"]["jax_ep"], result
  assert "jax_ep_local_dispatch_fp8" not in result["bf16"]["jax_ep"], result


@needs_extension
@pytest.mark.slow
def test_the_example_compiles_for_the_h200_with_the_mosaic_kernels():
  """examples/moe_transformer.py's training step as the example builds it on one GPU: its two
  layers share one scanned body, whose experts run 9 Mosaic GPU kernels (forward, its
  recomputation under remat, the backward's five); in FP8 with two micro-batches on jax_ep's
  own stream 16 (per micro-batch 2 + 2 + 4: the backward's weight gradients are two FP8
  kernels), every op of the pipeline on the stream and joined. The seconds each variant's
  trace, lowering and compile took are printed (no GPU: XLA's autotuning is not among them).
  Spills are the layer test's, at a model shape (the example's small sizes change them)."""
  result, output = _run("example")
  assert _ptxas_reports(output), output[-4000:]
  print({name: variant["seconds"] for name, variant in result.items()})
  assert result["bf16"]["mosaic"] == 9, result
  assert set(result["bf16"]["jax_ep"]) == {
      "jax_ep_local_layout", "jax_ep_local_dispatch", "jax_ep_local_combine",
      "jax_ep_local_combine_vjp"}, result
  own = result["fp8_mb2_own_stream"]
  assert own["mosaic"] == 16, result
  ops = {t: n for t, n in own["jax_ep"].items() if t != "jax_ep_join"}
  assert ops and all(t.endswith("_own_stream") for t in ops), result
  assert own["jax_ep"]["jax_ep_join"] == sum(ops.values()), result


def test_a_kernel_is_the_same_module_wherever_it_is_traced():
  """jax_ep's kernel modules carry neither Mosaic GPU's per-process dump number nor the
  caller's traceback: one grouped GEMM traced from two programs is one module (one hash), so
  a process builds it once; with a dump variable set (here ptxas's reports) Mosaic GPU's own
  modules are kept, numbered per trace."""
  result, _ = _run("stable_kernels", ptxas=False)
  first, second = result["programs"]
  assert result["stable"] and len(first) == 1 and first == second, result
  result, _ = _run("stable_kernels")
  first, second = result["programs"]
  assert not result["stable"] and first != second, result


def test_a_kernel_is_lowered_once_a_process():
  """A program that calls kernels another program of the process lowered reads their modules
  back instead of lowering them again (`compile_ahead._lowered_once`), and they are the bytes a
  lowering makes (the same hashes with the kept modules dropped)."""
  result, _ = _run("lowered_once", ptxas=False)
  first, second, third, fresh = result["programs"]
  kernels = len(set(first["kernels"]))
  assert result["stable"] and kernels >= 4, result
  assert first["lowered"] == kernels, result
  for n, again in enumerate((second, third), 1):
    assert again["kernels"] == first["kernels"] and again["lowered"] == kernels, result
    assert again["read_back"] == first["read_back"] + n * kernels, result
  assert fresh["kernels"] == first["kernels"] and fresh["lowered"] == 2 * kernels, result


@needs_extension
@pytest.mark.slow
def test_the_example_finds_its_kernels_compiled_ahead():
  """The example's training step compiled twice in one process (two learning rates: two
  programs): every kernel of each program was compiled ahead on a pool thread while the
  program was traced (`jax_ep.experts.compile_ahead`), none of those compiles failed, and the
  second program's kernels are the first's (built once a process); and each kernel was lowered
  once, by the pool or by the program, though a kernel traced inside a program and alone
  prints its nested jaxprs apart (`compile_ahead._printed`)."""
  result, _ = _run("compile_ahead", ptxas=False)
  first, second = (set(p["kernels"]) for p in result["programs"])
  assert result["stable"] and not result["failed"], result
  assert len(first) == 6 and first <= set(result["ahead"]), result
  assert second == first, result
  assert result["lowerings"]["lowered"] == len(result["ahead"]), result
