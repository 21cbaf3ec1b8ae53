"""The bytes each op of the MoE layer's compiled program reads and writes, compiled for a
compile-only H200 (jax_ep.testing.aot; no GPU needed): what `bench_layer.py`'s `moe_layer`
times (one rank, T=4096, the cuda backend, one micro-batch), forward or forward + backward,
bf16 or FP8. Each op's bytes are its operands' and results' sizes (an upper bound of its
traffic: a fusion may read less than a whole operand), summed over the entry computation and
the computations it calls.

  PYTHONPATH=.venv/cuda-aot JAX_PLATFORMS=cpu python scripts/compiled_bytes.py \\
      [--shape deepseek_v3_ep8_rank] [--variants bf16_fwd fp8_fwd_bwd ...] [--min-mb 1]
"""

from __future__ import annotations

import argparse
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
# Instructions that move no data of their own.
_FREE = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "opt-barrier",
         "call-done", "after-all", "partition-id", "replica-id"}
_CALLERS = {"call-start", "async-start", "while", "call", "conditional"}
# (experts, hidden, ffn, top-k) of the shapes bench_layer.py names.
SHAPES = {"deepseek_v3_ep8_rank": (32, 7168, 2048, 8), "deepseek_v3": (256, 7168, 2048, 8),
          "mixtral": (8, 4096, 14336, 2)}
TOKENS = 4096


def array_bytes(text: str) -> int:
  """The bytes of every array shape written in `text` (a shape or a tuple of them)."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * _BYTES[dtype]
  return total


def _computations(hlo: str):
  bodies, name, entry = {}, None, None
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if head:
      name = head.group(2)
      bodies[name] = []
      entry = name if head.group(1) else entry
    elif name and line.startswith("  "):
      bodies[name].append(line)
  return bodies, entry


def _label(opcode: str, line: str) -> str:
  target = re.search(r'custom_call_target="(\w+)"', line)
  op_name = re.search(r'op_name="([^"]*)"', line)
  op_name = op_name.group(1) if op_name else ""
  if target and target.group(1).startswith("mosaic_gpu"):
    kernel = re.search(r"(jax_ep_\w+)", op_name)
    return "mosaic " + (kernel.group(1) if kernel else op_name)
  if target:
    return "custom-call " + target.group(1)
  called = re.search(r"calls=%?([\w.\-]+)", line)
  return f"{opcode} {called.group(1) if called else ''} [{op_name.split('/')[-1]}]"


def ops(hlo: str) -> list[tuple[str, str, int]]:
  """`(label, result shape, bytes read + written)` of every op of the compiled module, in the
  order of its entry computation (called computations inlined where they are called)."""
  bodies, entry = _computations(hlo)
  rows = []

  def walk(name: str, depth: int):
    parsed = []
    for line in bodies[name]:
      m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$", line)
      if m:
        parsed.append((m.group(1), m.group(2), m.group(3), m.group(4), line))
    shapes = {n: shape for n, shape, *_ in parsed}
    for _, shape, opcode, rest, line in parsed:
      if opcode in _CALLERS:
        for callee in re.findall(r"(?:to_apply|calls|body)=\{?%?([\w.\-]+)", line):
          if callee in bodies and depth < 3:
            walk(callee, depth + 1)
        continue
      if opcode in _FREE:
        continue
      operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
      moved = array_bytes(shape) + sum(array_bytes(shapes.get(o, "")) for o in operands)
      rows.append((_label(opcode, line), re.sub(r"\{[^}]*\}", "", shape), moved))

  walk(entry, 0)
  return rows


def compiled_layer(shape: str, variant: str) -> str:
  """The optimized HLO of `moe_layer` at `shape`, `variant` `{bf16,fp8}_{fwd,fwd_bwd}`."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  import jax_ep
  import jax_ep.experts
  from jax_ep.testing import aot
  experts, hidden, ffn, topk = SHAPES[shape]
  device = aot.hopper_device()
  mesh = jax.sharding.Mesh(np.array([device]), ("ep",))
  group = jax_ep.Group(mesh, "ep", num_experts=experts, num_topk=topk, hidden=hidden,
                       max_tokens_per_rank=TOKENS, dtype=jnp.bfloat16, backend="cuda")
  params = jax.eval_shape(lambda: jax_ep.init_moe_params(
      jax.random.key(1), num_experts=experts, hidden=hidden, ffn=ffn, dtype=jnp.bfloat16))
  specs = jax_ep.layer.param_specs("ep", params)
  params = jax_ep.MoEParams(*(None if p is None else jax.ShapeDtypeStruct(
      p.shape, p.dtype, sharding=NamedSharding(mesh, s)) for p, s in zip(params, specs)))
  x = jax.ShapeDtypeStruct((TOKENS, hidden), jnp.bfloat16, sharding=NamedSharding(mesh, P("ep")))
  fp8 = variant.startswith("fp8")

  def loss(p, x):
    return jnp.mean(jax_ep.moe_mlp(group, p, x, fp8=fp8).out.astype(jnp.float32) ** 2)
  fn = (jax.grad(loss, (0, 1)) if variant.endswith("fwd_bwd")
        else lambda p, x: jax_ep.moe_mlp(group, p, x, fp8=fp8).out)
  with jax.set_mesh(mesh), jax.default_device(device), jax_ep.experts.override(impl="mosaic"):
    return jax.jit(fn).trace(params, x).lower().compile().as_text()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shape", default="deepseek_v3_ep8_rank", choices=sorted(SHAPES))
  parser.add_argument("--variants", nargs="+",
                      default=["bf16_fwd", "bf16_fwd_bwd", "fp8_fwd", "fp8_fwd_bwd"],
                      choices=["bf16_fwd", "bf16_fwd_bwd", "fp8_fwd", "fp8_fwd_bwd"])
  parser.add_argument("--min-mb", type=float, default=1.0,
                      help="list the ops that move at least this many MB")
  args = parser.parse_args()
  for variant in args.variants:
    rows = ops(compiled_layer(args.shape, variant))
    total = sum(moved for *_, moved in rows)
    print(f"\n=== {args.shape} {variant}: {len(rows)} ops, {total / 1e9:.2f} GB read + written")
    for label, shape, moved in rows:
      if moved >= args.min_mb * 1e6:
        print(f"  {moved / 1e6:9.1f} MB  {label[:64]:64s} -> {shape[:72]}")


if __name__ == "__main__":
  main()
