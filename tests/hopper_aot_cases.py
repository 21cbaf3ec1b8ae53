"""The cases of tests/test_hopper_aot.py, each run in a process of its own that can see JAX's
CUDA PJRT plugin: `python tests/hopper_aot_cases.py CASE [ARG]`. Each compiles jax_ep programs
for a compile-only H200 (jax_ep.testing.aot) and prints one line `RESULT <json>` for the test to
check; ptxas's report of every Mosaic GPU kernel goes to the output too (MOSAIC_GPU_DUMP_PTXAS).
"""

from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))

import jax_ep  # noqa: E402
from jax_ep.experts import builds, choice, configs, fp8, mlp, mlp_fp8  # noqa: E402
from jax_ep.testing import aot  # noqa: E402



def kernels(shape: str) -> dict:
  """Which kernel each product of the expert MLP takes at `shape`, bf16 and FP8; the choice
  compiles (probes) the builds it does not know, so one that does not build for sm_90a shows
  here as a fallback with the reason, and ptxas's reports show what was compiled."""
  from test_fused_expert_mlp import GPU_SHAPES  # the five model shapes of the GPU tests
  groups, hidden, ffn, rows = GPU_SHAPES[shape]
  bf16 = jnp.bfloat16
  choices = {
      "gate_up": lambda: choice.grouped_matmul_impl(rows, groups, hidden, ffn, bf16),
      "down": lambda: choice.grouped_matmul_impl(rows, groups, ffn, hidden, bf16),
      "fused_mlp": lambda: mlp.fused_mlp_impl(rows, groups, hidden, ffn, bf16, "swiglu"),
      "fp8_gate_up": lambda: fp8.fp8_matmul_impl(rows, groups, hidden, ffn),
      "fp8_down": lambda: fp8.fp8_matmul_impl(rows, groups, ffn, hidden),
      "fp8_mlp": lambda: mlp_fp8.fp8_mlp_impl(rows, groups, hidden, ffn, "swiglu"),
  }
  out = {}
  for name, choose in choices.items():
    # ptxas writes its reports to the process's stderr: the marker says whose follow.
    print(f"CHOICE {name}", file=sys.stderr, flush=True)
    out[name] = [str(part) for part in choose()]
  return out


def known_builds(which: str) -> dict:
  """Every build in `builds.KNOWN_BUILDS` of `which` kind ("bf16": the grouped GEMM and the
  fused MLP; "fp8"), compiled for sm_90a through the choice's own probe with the trust in known
  builds turned off: None, or why it did not build. The grouped GEMM at K=64 and K=256 (one
  reduction step, fewer than its stages, and several), the MLPs at the sizes and group count
  that make each (`builds.KNOWN_MLP_BUILDS`)."""
  builds.TRUST_KNOWN_BUILDS = False
  out = {}
  for build in sorted(builds.KNOWN_BUILDS, key=str):
    kind = build[0]
    if (kind.startswith("fp8") if which == "bf16" else not kind.startswith("fp8")):
      continue
    print(f"CHOICE {build}", file=sys.stderr, flush=True)
    if kind == "gmm":
      _, dtype, transpose_w, tiles, out_dtype = build
      for k in (64, 256):
        out[f"{build} k={k}"] = choice.mosaic_compile_error(
            512, 2, k, 256, np.dtype(dtype), transpose_w, tiles, np.dtype(out_dtype))
    elif kind == "fp8_gmm":
      out[str(build)] = fp8.fp8_compile_error(512, 2, 256, 256, build[1])
    elif kind == "fused_mlp":
      hidden, ffn, groups = builds.KNOWN_MLP_BUILDS[build]
      out[str(build)] = mlp.fused_compile_error(512, groups, hidden, ffn, np.dtype(build[1]),
                                                build[2])
    else:
      hidden, ffn, groups = builds.KNOWN_MLP_BUILDS[build]
      with configs.override(fp8_weight_grad=build[4] == "fp8"):  # the weight gradients'
        out[str(build)] = mlp_fp8.fp8_mlp_compile_error(512, groups, hidden, ffn, build[1])
  return out


def _weight_grad_builds(rows, k, n, groups, tiles_list, specialized: bool) -> dict:
  """Each of `tiles_list`'s weight-gradient kernels on the rows in place and on aligned copies,
  compiled for sm_90a: None, or why it did not build."""
  from jax_ep.experts import hopper_wgrad
  args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
          jax.ShapeDtypeStruct((rows, n), jnp.bfloat16), jax.ShapeDtypeStruct((groups,), jnp.int32))
  out = {}
  for aligned in (False, True):
    for tiles in tiles_list:
      print(f"CHOICE {tiles} aligned={aligned}", file=sys.stderr, flush=True)
      fn = jax.jit(lambda x, dy, s, t=tiles, a=aligned: hopper_wgrad.grouped_weight_grad_kernel(
          x, dy, s, tiles=t, specialized=specialized, aligned=a))
      try:
        fn.trace(*args).lower().compile()
        out[f"{tiles} aligned={aligned}"] = None
      except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        out[f"{tiles} aligned={aligned}"] = f"{type(e).__name__}: {str(e)[:300]}"
  return out


def weight_grad_runs(_=None) -> dict:
  """Each weight-gradient pipeline through runs of groups that `bench_layer.py --tune
  weight_grad_runs` times (`configs.weight_grad_run_tiles`, on the rows in place and on aligned
  copies), compiled for sm_90a at DeepSeek-V3's gate projection (256 experts, 7168 x 2048):
  None, or why it did not build."""
  return _weight_grad_builds(32768, 7168, 2048, 256, configs.weight_grad_run_tiles(),
                             specialized=False)


def weight_grad_wgs(_=None) -> dict:
  """The warp-specialized weight gradient with two compute warpgroups that `bench_layer.py
  --tune weight_grad_wgs` times (2 and 3 stages, the rows in place and aligned copies),
  compiled for sm_90a at one rank of DeepSeek-V3 at EP=8 (32 experts, 7168 x 2048): None, or
  why it did not build."""
  return _weight_grad_builds(
      32768, 7168, 2048, 32,
      [configs.KernelTiles(128, 128, 64, stages, 4, compute_wgs=2) for stages in (2, 3)],
      specialized=True)


def dequantize_rows(_=None) -> dict:
  """`jax_ep.dequantize` of the rows inside the groups (jax_ep's Pallas Triton kernel) under
  vmap and grad, an fp8 dispatch's buffer at DeepSeek-V3's hidden size, compiled for sm_90a:
  whether the compiled program calls the kernel."""
  rows, hidden = 4096, 7168
  args = (jax.ShapeDtypeStruct((2, rows, hidden), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((2, rows, hidden // 128), jnp.float32),
          jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2, 4), jnp.int32))

  def loss(q, s, sizes, offsets):
    out = jax.vmap(lambda *a: jax_ep.dequantize(*a[:2], jnp.bfloat16, group_sizes=a[2],
                                                group_offsets=a[3]))(q, s, sizes, offsets)
    return jnp.sum(out.astype(jnp.float32)), out  # the rows an output: not dead code
  compiled = jax.jit(jax.grad(loss, has_aux=True)).lower(*args).compile().as_text()
  return {"kernel": "jax_ep_fp8_dequantize_rows" in compiled}


def specialized_fused(_=None) -> dict:
  """The fused MLP's warp-specialized gated projections and hidden gradient (two compute
  warpgroups of 64 columns, 4 stages: `SPECIALIZED_FUSED`), compiled for sm_90a together in
  the MLP's forward and backward at one rank of DeepSeek-V3 at EP=8 (32 experts, 7168 x
  2048), a gated and a plain activation: None, or why it did not build."""
  rows, groups, hidden, ffn = 32768, 32, 7168, 2048
  out = {}
  for activation in ("swiglu", "gelu"):
    print(f"CHOICE {SPECIALIZED_FUSED} {activation}", file=sys.stderr, flush=True)
    gated = activation in mlp.GATED
    w = jax.ShapeDtypeStruct((groups, hidden, ffn), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16), w, w if gated else None,
            jax.ShapeDtypeStruct((groups, ffn, hidden), jnp.bfloat16),
            jax.ShapeDtypeStruct((groups,), jnp.int32),
            jax.ShapeDtypeStruct((rows, hidden), jnp.bfloat16))

    def backward(x, wg, wu, wd, s, dy, a=activation):
      y, pullback = jax.vjp(lambda x, wg, wu, wd: jax_ep.expert_mlp(
          x, wg, wu, wd, s, activation=a), x, wg, wu, wd)
      return y, pullback(dy)
    try:
      with configs.override(fused_gated_tiles=SPECIALIZED_FUSED,
                            fused_hidden_grad_tiles=SPECIALIZED_FUSED):
        jax.jit(backward).trace(*args).lower().compile()
      out[activation] = None
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
      out[activation] = f"{type(e).__name__}: {str(e)[:300]}"
  return out


SPECIALIZED_FUSED = configs.KernelTiles(128, 64, 64, 4, 4, compute_wgs=2)


def streams(_=None) -> dict:
  """tests/test_comm_stream.py's programs compiled for the H200, with `comm_stream=1`, without,
  and on jax_ep's own stream: the jax_ep custom calls of the lowered program (target -> count)
  and of the compiled one (target -> whether each call sits in an async call's body: XLA's
  wrapper of an annotated op, on the stream)."""
  import test_comm_stream as cs
  devices = aot.hopper_devices(2)
  out = {}
  for kind in ("local", "peer", "local_fp8", "network"):
    for program in ("jit", "grad", "checkpoint_grad", "vmap", "scan", "scan_checkpoint_grad"):
      for stream in (1, None, "jax_ep"):
        backend = cs._backend(kind, stream)
        fn = cs._programs(backend, devices)[program]
        ranks = backend.config.num_ranks if kind == "network" else 1
        args = aot.abstract(jax.eval_shape(cs._inputs), NamedSharding(jax.sharding.Mesh(
            np.array(devices[:ranks]), ("ep",)), P()))
        lowered = jax.jit(fn).trace(*args).lower()
        out[f"{kind}/{program}/{stream}"] = {
            "lowered": _lowered_calls(lowered.as_text()),
            "compiled": cs.async_homes(lowered.compile().as_text())}
  return out


def _lowered_calls(text: str) -> dict:
  """jax_ep custom call target -> how many calls of it the lowered program makes."""
  counts = {}
  for target in re.findall(r"custom_call @(jax_ep_\w+)", text):
    counts[target] = counts.get(target, 0) + 1
  return counts


def _schedule(hlo: str) -> list[list[str]]:
  """The entry computation's ops in XLA's order (the module is scheduled), each as
  `[kind, what, id]`: kind `start` / `done` for an async call around a jax_ep op (what: its
  target, or `get-tuple-element` around one output of a multi-result op; id: the start's name),
  `kernel` for a Mosaic GPU kernel, `gemm` for a cuBLAS or Triton GEMM; nothing else."""
  computations, current, entry = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if head:
      current = head.group(2)
      entry = current if head.group(1) else entry
      computations[current] = []
    elif current and line.startswith("  "):
      computations[current].append(line)

  def target(name, depth=0):
    lines = computations.get(name, [])
    for line in lines:
      found = re.search(r'custom_call_target="(jax_ep_\w+)"', line)
      if found:
        return found.group(1)
      # XLA's dynamic-slice fusion may hold the call (with the micro-batch's slice of x).
      inner = re.search(r"calls=%?([\w.\-]+)", line)
      held = target(inner.group(1), depth + 1) if inner and depth < 2 else "?"
      if held not in ("?", "get-tuple-element"):
        return held
    return "get-tuple-element" if any("get-tuple-element(" in line for line in lines) else "?"
  started, order = {}, []
  for line in computations[entry]:
    op = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\(", line)
    if not op:
      continue
    name, kind = op.groups()
    own = re.search(r'custom_call_target="(jax_ep_\w+_own_stream|jax_ep_join)"', line)
    if own:
      # An op on jax_ep's own stream, or a join: the join waits for the latest op of its key.
      key = "key" + re.search(r"own_stream_key = (\d+)", line).group(1)
      order.append(["done" if own.group(1) == "jax_ep_join" else "start", own.group(1), key])
    elif kind == "call-start":
      started[name] = target(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
      order.append(["start", started[name], name])
    elif kind == "call-done":
      of = re.search(r"call-done\(%?([\w.\-]+)", line).group(1)
      order.append(["done", started.get(of, "?"), of])
    elif 'custom_call_target="mosaic_gpu' in line:
      order.append(["kernel", "", name])
    elif "gemm" in name or "__cublas" in line:
      order.append(["gemm", "", name])
  return order


def overlap(order, comm: float, kernel: float = 1.0, gemm: float = 0.1) -> dict:
  """What the schedule hides, on a model of the two streams: the compute stream runs its
  kernels in order; an async start makes the other stream wait for everything issued before it
  on the compute stream and for the other stream's earlier ops (XLA's semantics for an
  annotated op), and its done makes the compute stream wait for the op. Costs: a Mosaic kernel
  `kernel`, a GEMM `gemm`, a dispatch / combine `comm`, anything else (the layout, an output's
  async call) nothing. `hidden`: the communication time the schedule hides, as a fraction of
  all of it (the longest run of both streams against their sum)."""
  def cost(kind, what):
    if kind == "kernel":
      return kernel
    if kind == "gemm":
      return gemm
    return comm if re.search(r"dispatch|combine", what) else 0.0
  compute = stream = 0.0
  ends, total_comm, serial = {}, 0.0, 0.0
  for kind, what, name in order:
    if kind in ("kernel", "gemm"):
      compute += cost(kind, what)
      serial += cost(kind, what)
    elif kind == "start":
      stream = max(stream, compute) + cost(kind, what)
      ends[name] = stream
      total_comm += cost(kind, what)
      serial += cost(kind, what)
    else:
      compute = max(compute, ends[name])
  span = max(compute, stream)
  return {"serial": serial, "span": span,
          "hidden": (serial - span) / total_comm if total_comm else 0.0}


def schedule(arg=None) -> dict:
  """The MoE layer at one rank (DeepSeek-V3 at EP=8's experts, T=4096) on the cuda backend with
  two micro-batches, forward (`arg` has "forward") or forward and backward, with `comm_stream=1`
  or (`arg` has "own") jax_ep's own stream: XLA's order of the ops' starts and dones (on the
  own stream: the ops and their joins) and of the GEMMs (`order`), what it hides on `overlap`'s
  model with a dispatch or combine at a quarter and at a whole expert kernel, and the ops and
  joins on the own stream that read a copy (`copied_into_joins`).
  `JAX_EP_AOT_COMPILER_OPTIONS` (a JSON object) passes XLA options to the compile."""
  tokens, experts, topk, hidden, ffn = 4096, 32, 8, 7168, 2048
  device = aot.hopper_device()
  mesh = jax.sharding.Mesh(np.array([device]), ("ep",))
  words = set((arg or "").split(","))
  group = jax_ep.Group(mesh, "ep", num_experts=experts, num_topk=topk, hidden=hidden,
                       max_tokens_per_rank=tokens, backend="cuda",
                       comm_stream="jax_ep" if "own" in words else 1)
  params = jax.eval_shape(lambda: jax_ep.init_moe_params(
      jax.random.key(0), num_experts=experts, hidden=hidden, ffn=ffn))
  replicated = NamedSharding(mesh, P())
  args = aot.abstract((params, jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)),
                      replicated)

  def loss(p, x):
    return jnp.sum(jax_ep.moe_mlp(group, p, x, micro_batches=2).out.astype(jnp.float32) ** 2)
  fn = (lambda p, x: jax_ep.moe_mlp(group, p, x, micro_batches=2).out) if "forward" in words \
      else jax.grad(loss, (0, 1))
  options = json.loads(os.environ.get("JAX_EP_AOT_COMPILER_OPTIONS", "{}"))
  hlo = jax.jit(fn).trace(*args).lower().compile(options).as_text()
  order = _schedule(hlo)
  return {"order": order, "overlap": {c: overlap(order, c) for c in (0.25, 1.0)},
          "copied_into_joins": _copied_into_joins(hlo)}


def _copied_into_joins(hlo: str) -> list[str]:
  """The ops on jax_ep's stream and joins that read a copy (through tuples, barriers and
  bitcasts): XLA copies a buffer it cannot alias, and a copy of an op's result made before its
  join would read it while the op still writes it; an op reading a copy of its operand would
  read a buffer its join does not keep."""
  made = {}  # instruction -> (opcode, operands)
  for line in hlo.splitlines():
    op = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = .*? ([\w\-]+)\((.*)", line)
    if op:
      made[op.group(1)] = (op.group(2), re.findall(r"%([\w.\-]+)", op.group(3).split("),")[0]))
  passthrough = {"get-tuple-element", "tuple", "opt-barrier", "bitcast"}

  def copied(name, seen):
    if name in seen or name not in made:
      return False
    seen.add(name)
    kind, operands = made[name]
    return kind == "copy" or (kind in passthrough and any(copied(o, seen) for o in operands))
  found = []
  for line in hlo.splitlines():
    if re.search(r'custom_call_target="(jax_ep_\w+_own_stream|jax_ep_join)"', line):
      name = re.match(r"\s+(?:ROOT )?%([\w.\-]+)", line).group(1)
      if any(copied(o, set()) for o in made[name][1]):
        found.append(name)
  return found


def layer(_=None) -> dict:
  """The MoE layer at one rank on the cuda backend, forward and backward, as users call it
  (`jax_ep.moe_mlp` inside `jax.jit`, its `shard_map` within), in bf16 and in FP8 with `remat`
  and two micro-batches, compiled for the H200: per variant, how many Mosaic GPU kernels the
  program runs (a product that fell back to XLA would lower the count) and its jax_ep custom
  calls; the FP8 variant again on jax_ep's own stream (its pipeline)."""
  tokens, experts, topk, hidden, ffn = 2048, 32, 8, 7168, 2048
  device = aot.hopper_device()
  mesh = jax.sharding.Mesh(np.array([device]), ("ep",))
  params = jax.eval_shape(lambda: jax_ep.init_moe_params(
      jax.random.key(0), num_experts=experts, hidden=hidden, ffn=ffn))
  replicated = NamedSharding(mesh, P())
  args = aot.abstract((params, jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)),
                      replicated)
  out = {}
  for name, fp8_, remat, micro_batches, stream in (
      ("bf16", False, False, 1, None), ("fp8_remat_mb2", True, True, 2, None),
      ("fp8_remat_mb2_own_stream", True, True, 2, "jax_ep")):
    group = jax_ep.Group(mesh, "ep", num_experts=experts, num_topk=topk, hidden=hidden,
                         max_tokens_per_rank=tokens, backend="cuda",
                         wire_format="fp8" if fp8_ else None, comm_stream=stream)

    def loss(p, x, group=group, fp8_=fp8_, remat=remat, micro_batches=micro_batches):
      y = jax_ep.moe_mlp(group, p, x, fp8=fp8_, remat=remat, micro_batches=micro_batches).out
      return jnp.sum(y.astype(jnp.float32) ** 2)
    hlo = jax.jit(jax.grad(loss, (0, 1))).trace(*args).lower().compile().as_text()
    calls = {}
    for target in re.findall(r'custom_call_target="(jax_ep_\w+)"', hlo):
      calls[target] = calls.get(target, 0) + 1
    out[name] = {"mosaic": hlo.count('custom_call_target="mosaic_gpu'), "jax_ep": calls}
  return out


def _example_step(comm_stream=None, **settings):
  """`(mesh, step, abstract state, abstract tokens)`: examples/moe_transformer.py's training
  step (its default model with `settings` replaced: two layers under Flax's scan and remat,
  AdamW) on a 1 x 1 ('data', 'expert') mesh of the H200, the cuda backend's one-rank group, as
  the example builds it."""
  import dataclasses

  import optax
  from flax import nnx
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
  import moe_transformer as ex

  device = aot.hopper_device()
  mesh = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("data", "expert"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  cfg = dataclasses.replace(ex.CONFIGS["default"], **settings)
  group = jax_ep.Group(mesh, "expert", num_experts=cfg.experts, num_topk=cfg.topk,
                       hidden=cfg.hidden, dtype=ex.COMPUTE, backend="cuda",
                       comm_stream=comm_stream, max_tokens_per_rank=cfg.batch * cfg.seq_len)
  with jax.set_mesh(mesh):
    model, optimizer = nnx.eval_shape(lambda: (lambda m: (
        m, nnx.Optimizer(m, optax.adamw(cfg.lr, weight_decay=1e-2), wrt=nnx.Param)))(
            ex.Transformer(cfg, group, group, nnx.Rngs(0))))
  graphdef, state = nnx.split((model, optimizer))
  state = aot.abstract(state, NamedSharding(mesh, P()))
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len + 1), jnp.int32,
                                sharding=NamedSharding(mesh, P(("data", "expert"))))

  def step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    (_, nll), grads = nnx.value_and_grad(ex.loss_fn, has_aux=True)(model, tokens,
                                                                    cfg.aux_coef)
    optimizer.update(model, grads)
    return nll, nnx.state((model, optimizer))

  return mesh, step, state, tokens


def example(impl=None) -> dict:
  """examples/moe_transformer.py's training step (its default model: two layers under Flax's
  scan and remat, AdamW) on a 1 x 1 ('data', 'expert') mesh of the H200, the cuda backend's
  one-rank group, as the example builds it, in bf16 and with `--fp8 --micro-batches 2
  --comm-stream jax_ep`: per variant the Mosaic GPU kernels and the jax_ep custom calls of the
  compiled program, and the seconds its trace, lowering and compile took here (XLA's GEMM
  autotuning does not run without a GPU). `impl` "xla": the expert products in XLA
  (`experts.override(impl="xla", fused_mlp=False)`), no Mosaic GPU kernel: what the kernels
  add to the compile."""
  import contextlib
  import time

  out = {}
  for name, fp8_, micro_batches, stream in (("bf16", False, 1, None),
                                            ("fp8_mb2_own_stream", True, 2, "jax_ep")):
    mesh, step, state, tokens = _example_step(fp8=fp8_, micro_batches=micro_batches,
                                              comm_stream=stream)
    products = (jax_ep.experts.override(impl="xla", fused_mlp=False) if impl == "xla"
                else contextlib.nullcontext())
    with jax.set_mesh(mesh), products:
      t0 = time.perf_counter()
      traced = jax.jit(step).trace(state, tokens)
      t1 = time.perf_counter()
      lowered = traced.lower()
      t2 = time.perf_counter()
      hlo = lowered.compile().as_text()
      t3 = time.perf_counter()
    calls = {}
    for target in re.findall(r'custom_call_target="(jax_ep_\w+)"', hlo):
      calls[target] = calls.get(target, 0) + 1
    out[name] = {"mosaic": hlo.count('custom_call_target="mosaic_gpu'), "jax_ep": calls,
                 "seconds": {"trace": round(t1 - t0, 1), "lower": round(t2 - t1, 1),
                             "compile": round(t3 - t2, 1)}}
  return out


def _kernel_hashes(text: str) -> list[str]:
  """The `kernel_hash` of each Mosaic GPU kernel in a lowered program's text, as printed."""
  return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)


def stable_kernels(_=None) -> dict:
  """One grouped GEMM kernel lowered from two call sites (two programs, two tracebacks): each
  program's kernel hashes, and whether jax_ep made its kernels' modules stable in this process
  (`compile_ahead.stable_modules`: not where a `MOSAIC_GPU_DUMP*` variable is set)."""
  from jax_ep.experts import compile_ahead
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)

  def first(x, w, sizes):
    return jax_ep.grouped_matmul(x, w, sizes)

  def second(x, w, sizes):  # another line, another traceback
    return 2 * jax_ep.grouped_matmul(x, w, sizes)

  with jax_ep.experts.override(compile_ahead=False):
    programs = [_kernel_hashes(jax.jit(f).trace(x, w, sizes).lower().as_text())
                for f in (first, second)]
  return {"stable": compile_ahead.stable_modules(), "programs": programs}


def lowered_once(_=None) -> dict:
  """The expert MLP's forward and backward lowered in three programs of one process (another
  scale of the loss each: other programs, the same kernels), then once more with the kept
  modules dropped: each program's kernel hashes and how many kernel modules the process had
  lowered and read back after it (`compile_ahead.lowerings`)."""
  from jax_ep.experts import compile_ahead as ahead
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  out = {"stable": ahead.stable_modules(), "programs": []}
  with jax_ep.experts.override(compile_ahead=False):
    for scale in (1.0, 2.0, 3.0, None):
      if scale is None:
        with ahead._LOCK:
          ahead._LOWERED.clear()

      def loss(x, w, sizes, scale=scale or 1.0):
        y = jax_ep.expert_mlp(x, w, w, jnp.swapaxes(w, 1, 2), sizes)
        return scale * jnp.sum(y.astype(jnp.float32))
      text = jax.jit(jax.grad(loss, (0, 1))).trace(x, w, sizes).lower().as_text()
      out["programs"].append({"kernels": _kernel_hashes(text), **ahead.lowerings()})
  return out


def compile_ahead(_=None) -> dict:
  """The example's training step compiled in one process twice (the second with another
  learning rate: another program, the same kernels), the kernels compiled ahead on pool
  threads (`jax_ep.experts.compile_ahead`): the hashes of the kernels compiled ahead and of
  each program's, the compiles that failed, and each program's seconds here."""
  import time

  from jax_ep.experts import compile_ahead as ahead
  compiled_ahead = set()
  original = ahead._compile

  def recording(kernel, operands, device, overrides):
    with jax.default_device(device):
      compiled_ahead.update(_kernel_hashes(jax.jit(kernel).trace(*operands).lower().as_text()))
    original(kernel, operands, device, overrides)

  ahead._compile = recording
  out = {"stable": ahead.stable_modules(), "programs": []}
  for lr in (3e-3, 1e-3):
    mesh, step, state, tokens = _example_step(lr=lr)
    with jax.set_mesh(mesh):
      t0 = time.perf_counter()
      lowered = jax.jit(step).trace(state, tokens).lower()
      t1 = time.perf_counter()
      lowered.compile()
      t2 = time.perf_counter()
    out["programs"].append({"kernels": _kernel_hashes(lowered.as_text()),
                            "seconds": {"trace_and_lower": round(t1 - t0, 1),
                                        "compile": round(t2 - t1, 1)}})
  ahead.wait()
  out["lowerings"] = ahead.lowerings()
  out["ahead"] = sorted(compiled_ahead)
  out["failed"] = [repr(f.exception()) for f in ahead.pending() if f.exception()]
  return out


def shared_weights(_=None) -> dict:
  """`jax.grad` of 1 and of 4 FP8 `expert_mlp` calls on one set of `Fp8Weights` (quantised once,
  as a step does for its micro-batches), compiled for the H200: per count, the e4m3 weight-sized
  arrays the program's XLA ops write (the backward's transposes of the weights into the layouts
  its products read: XLA should compute them once for all the calls) and its Mosaic kernels."""
  groups, hidden, ffn, rows = 8, 1024, 512, 4096
  bf16 = jnp.bfloat16
  out = {}
  for calls in (1, 4):
    def loss(x, wg, wu, wd, sizes, cot, calls=calls):
      weights = [jax_ep.quantize_weights(w) for w in (wg, wu, wd)]
      total = 0.0
      for i in range(calls):
        y = jax_ep.expert_mlp(x[i], *weights, sizes, fp8=True)
        total = total + jnp.sum(y.astype(jnp.float32) * cot[i])
      return total
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((calls, rows, hidden), bf16), ((groups, hidden, ffn), bf16),
        ((groups, hidden, ffn), bf16), ((groups, ffn, hidden), bf16), ((groups,), jnp.int32),
        ((calls, rows, hidden), jnp.float32))]
    hlo = jax.jit(jax.grad(loss, (0, 1, 2, 3))).trace(*args).lower().compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    written = re.findall(r"= (f8e4m3fn\[\d+,\d+,\d+\])\S* (?:fusion|transpose|copy)\(", entry)
    out[str(calls)] = {"weights_written": sorted(written),
                       "mosaic": entry.count('custom_call_target="mosaic_gpu')}
  return out


CASES = {"kernels": kernels, "known_builds": known_builds, "weight_grad_runs": weight_grad_runs,
         "weight_grad_wgs": weight_grad_wgs, "specialized_fused": specialized_fused,
         "dequantize_rows": dequantize_rows,
         "streams": streams, "schedule": schedule, "layer": layer, "example": example,
         "shared_weights": shared_weights, "stable_kernels": stable_kernels,
         "lowered_once": lowered_once, "compile_ahead": compile_ahead}

if __name__ == "__main__":
  case, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
  with jax.default_device(aot.hopper_device()):
    result = CASES[case](arg)
  print("RESULT " + json.dumps(result), flush=True)
