"""The MoE layer trains on GPUs: `jax_ep.moe_mlp` and `jax_ep.nnx.MoE`, forward and backward, at
the expert shapes of real models, against the dense model (`jax_ep.testing.dense`).

GPU only (marked `gpu`): on Hopper the experts run jax_ep's Mosaic GPU grouped GEMM inside
`shard_map`, the path whose backward the CPU cannot run. One GPU:

  python -m pytest tests/test_gpu_layer.py -q                                   # R = 1
  python -m jax_ep.launch -n 4 --share-gpu -- python -m pytest tests/test_gpu_layer.py -q  # R = 4

Under the launcher every process builds the same host arrays, runs the layer on the whole mesh,
computes the dense model on its own device, and compares the shards it holds: its tokens'
outputs and input gradients, its experts' weight gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
from ep_test_base import rank_mesh
from jax_ep.layer import MoEParams
from jax_ep.testing.dense import dense_moe_layer

pytestmark = pytest.mark.gpu

# name: (experts, hidden, ffn, top-k); DeepSeek-V3's ffn is cut to 512 where the dense twin's
# replicated weights (and their gradients) would not fit one GPU beside R processes' layers.
SHAPES = {
    "deepseek_v3": (256, 7168, 2048, 8),
    "qwen3_30b_a3b": (128, 2048, 768, 8),
    "e32": (32, 4096, 1536, 4),
    "mixtral": (8, 4096, 14336, 2),
}
TOKENS = 256  # per rank


def _shape(name, num_ranks):
  e, h, f, k = SHAPES[name]
  if name == "deepseek_v3" and num_ranks > 1:
    f = 512
  return e, h, f, k


def _mesh():
  num_ranks = jax.device_count()
  if jax.devices()[0].platform != "gpu":
    pytest.skip("needs GPUs")
  return rank_mesh(num_ranks), num_ranks


def _inputs(num_experts, hidden, ffn, tokens, seed=0, param_dtype=jnp.bfloat16, key=None):
  """Params, x and the output cotangent drawn on this process's device, the same values in every
  process (one seed)."""
  k_p, k_x, k_c = jax.random.split(jax.random.key(seed), 3)
  params = jax_ep.init_moe_params(k_p if key is None else key, num_experts=num_experts,
                                  hidden=hidden, ffn=ffn, dtype=param_dtype)
  x = jax.random.normal(k_x, (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
  cot = jax.random.normal(k_c, (tokens, hidden), jnp.float32)
  return params, x, cot


def _global(mesh, array, spec):
  """`array` (on this process's device, the same in every process) as a global array laid out
  by `spec` over `mesh`."""
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])


def _chunks(array, max_bytes=1 << 30):
  """Slices of `array`'s leading axis of at most `max_bytes` each as float32 (at least one row)."""
  rows = array.shape[0] if array.ndim else 1
  per_row = max(4 * array.size // max(rows, 1), 1)
  step = max(1, max_bytes // per_row)
  return [slice(i, min(i + step, rows)) for i in range(0, rows, step)] if array.ndim else [()]


def _assert_close(got, want, rel, what):
  """Each shard of `got` this process holds against the same block of the dense `want`, to the
  scale of the whole `want`; computed on the device a slice at a time (the arrays are GBs at
  DeepSeek-V3's shape: float32 copies of whole weight gradients beside the layer's do not fit)."""
  f32 = jnp.float32
  scale = max(float(jnp.max(jnp.abs(want[c].astype(f32)))) for c in _chunks(want))
  assert scale > 0, f"{what}: the dense reference is all zero"
  for shard in got.addressable_shards:
    ref_all = jax.device_put(want[shard.index], shard.data.device)
    for c in _chunks(shard.data):
      block = shard.data[c].astype(f32)
      ref = ref_all[c].astype(f32)
      assert bool(jnp.isfinite(block).all()), f"{what}: not finite"
      err = float(jnp.max(jnp.abs(block - ref)))
      assert err <= rel * scale, f"{what}: max abs err {err:.3e} > {rel:g} * {scale:.3e}"


def _dense(params, x, cot, num_topk):
  """The dense model on this process's device, computing in bf16 like the layer: output and
  gradients (params, x)."""
  def loss(params, x):
    out = dense_moe_layer(params, x, num_topk, dtype=jnp.bfloat16)
    return jnp.sum(out.astype(jnp.float32) * cot), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, grads


def _nnx_grads(model, x, cot):
  """The gradients of `sum(model(x) * cot)` with respect to the module and `x`, in one compiled
  step."""
  nnx = pytest.importorskip("flax.nnx")

  @nnx.jit
  def step(model, x, cot):
    def loss(model, x):
      return jnp.sum(model(x).astype(jnp.float32) * cot)
    return nnx.grad(loss, argnums=(0, 1))(model, x)
  return step(model, x, cot)


@pytest.mark.parametrize("name", list(SHAPES))
def test_moe_mlp_trains_at_model_shapes(name, expert_alignment=1):
  mesh, num_ranks = _mesh()
  e, h, f, k = _shape(name, num_ranks)
  params, x, cot = _inputs(e, h, f, num_ranks * TOKENS)
  want_out, (want_params, want_x) = _dense(params, x, cot, k)
  with jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h,
                    max_tokens_per_rank=TOKENS, dtype=jnp.bfloat16,
                    expert_alignment=expert_alignment) as group:
    assert group.backend_name == "cuda", group.backend_reason
    g_params = MoEParams(*(None if p is None else _global(mesh, p, s) for p, s in
                           zip(params, jax_ep.layer.param_specs("ep", params))))
    del params
    g_x, g_cot = _global(mesh, x, P("ep")), _global(mesh, cot, P("ep"))

    def loss(params, x, cot):
      result = jax_ep.moe_mlp(group, params, x)
      return jnp.sum(result.out.astype(jnp.float32) * cot), result
    (_, result), (d_params, d_x) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(g_params, g_x, g_cot)
    jax.block_until_ready(d_x)
    group.check()
  assert not any(int(s.data.sum()) for s in result.num_dropped.addressable_shards)
  _assert_close(result.out, want_out, 3e-2, "out")
  _assert_close(d_x, want_x, 3e-2, "grad x")
  for field in ("router", "w_gate", "w_up", "w_down"):
    got, want = getattr(d_params, field), getattr(want_params, field)
    assert got.dtype == want.dtype, f"grad {field}: {got.dtype} != {want.dtype}"
    _assert_close(got, want, 3e-2, f"grad {field}")


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "e32"])
@pytest.mark.parametrize("expert_alignment", [64, 128])
def test_moe_mlp_trains_with_expert_alignment(name, expert_alignment):
  """As above on a group whose experts' rows start at multiples of a row tile: the grouped
  GEMM's kernels take the dispatch's group_offsets (padding between the experts' rows)."""
  test_moe_mlp_trains_at_model_shapes(name, expert_alignment)


@pytest.mark.parametrize("name", list(SHAPES))
def test_nnx_module_trains_at_model_shapes(name):
  """The NNX module's training step, its weights stored in float32 and computed in bf16 (the
  group's dtype), as Flax layers do; DeepSeek-V3's stored in bf16 (float32 weights, their
  gradients and the dense twin's would not fit one GPU)."""
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE
  mesh, num_ranks = _mesh()
  e, h, f, k = _shape(name, num_ranks)
  param_dtype = jnp.bfloat16 if name == "deepseek_v3" else jnp.float32
  # The module draws its weights from rngs.params() exactly so; every process draws the same.
  params, x, cot = _inputs(e, h, f, num_ranks * TOKENS, seed=1, param_dtype=param_dtype,
                           key=nnx.Rngs(0).params())
  _, (want_params, want_x) = _dense(params, x, cot, k)
  with jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h,
                    max_tokens_per_rank=TOKENS, dtype=jnp.bfloat16) as group:
    model = MoE(group, ffn=f, rngs=nnx.Rngs(0), param_dtype=param_dtype)
    _assert_close(model.w_gate[...], params.w_gate, 0.0, "the module's weights")
    del params
    g_x, g_cot = _global(mesh, x, P("ep")), _global(mesh, cot, P("ep"))
    d_model, d_x = _nnx_grads(model, g_x, g_cot)
    jax.block_until_ready(d_x)
    group.check()
  _assert_close(d_x, want_x, 3e-2, "grad x")
  for field in ("w_gate", "w_down"):
    got = getattr(d_model, field)[...]
    assert got.dtype == param_dtype, f"grad {field}: {got.dtype}"
    _assert_close(got, getattr(want_params, field), 3e-2, f"grad {field}")


def test_nnx_module_trains_and_decodes_on_one_set_of_weights():
  """One `jax_ep.nnx.MoE` for training and decode: a training step (dispatch, the grouped GEMM,
  combine) and a decode call (`mode="low_latency"` on its decode group: the low-latency kernels
  and the slab experts) on the same weights, each against the dense model."""
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE
  mesh, num_ranks = _mesh()
  e, h, f, k = SHAPES["e32"]
  decode_tokens = 8  # per rank
  params, x, cot = _inputs(e, h, f, num_ranks * TOKENS, seed=3, param_dtype=jnp.float32,
                           key=nnx.Rngs(0).params())
  _, (want_params, want_x) = _dense(params, x, cot, k)
  x_decode = x[:num_ranks * decode_tokens]
  want_decode = jax.jit(lambda p, x: dense_moe_layer(p, x, k, dtype=jnp.bfloat16))(params,
                                                                                    x_decode)
  options = dict(num_experts=e, num_topk=k, hidden=h, dtype=jnp.bfloat16)
  with jax_ep.Group(mesh, "ep", max_tokens_per_rank=TOKENS, **options) as group, \
       jax_ep.Group(mesh, "ep", max_tokens_per_rank=decode_tokens, low_latency=True,
                    **options) as decode_group:
    assert decode_group.backend_name == "cuda", decode_group.backend_reason
    model = MoE(group, ffn=f, rngs=nnx.Rngs(0), decode_group=decode_group)
    del params
    g_x, g_cot = _global(mesh, x, P("ep")), _global(mesh, cot, P("ep"))
    d_model, d_x = _nnx_grads(model, g_x, g_cot)
    decoded = nnx.jit(lambda m, x: m(x, mode="low_latency"))(model,
                                                              _global(mesh, x_decode, P("ep")))
    jax.block_until_ready((d_x, decoded))
    group.check()
    decode_group.check()
  _assert_close(d_x, want_x, 3e-2, "grad x")
  _assert_close(d_model.w_gate[...], want_params.w_gate, 3e-2, "grad w_gate")
  _assert_close(decoded, want_decode, 3e-2, "decoded out")


def test_moe_mlp_low_latency_trains_at_a_model_shape():
  """The decode layer (`mode="low_latency"`: the low-latency pair, the experts on its slabs
  through the Pallas slab kernels) forward and backward inside shard_map."""
  mesh, num_ranks = _mesh()
  e, h, f, k = SHAPES["e32"]
  tokens = 128
  params, x, cot = _inputs(e, h, f, num_ranks * tokens, seed=2)
  want_out, (want_params, want_x) = _dense(params, x, cot, k)
  with jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h,
                    max_tokens_per_rank=tokens, dtype=jnp.bfloat16, low_latency=True) as group:
    g_params = MoEParams(*(None if p is None else _global(mesh, p, s) for p, s in
                           zip(params, jax_ep.layer.param_specs("ep", params))))
    g_x, g_cot = _global(mesh, x, P("ep")), _global(mesh, cot, P("ep"))

    def loss(params, x, cot):
      out = jax_ep.moe_mlp(group, params, x, mode="low_latency").out
      return jnp.sum(out.astype(jnp.float32) * cot), out
    (_, out), (d_params, d_x) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(g_params, g_x, g_cot)
    jax.block_until_ready(d_x)
    group.check()
  _assert_close(out, want_out, 3e-2, "out")
  _assert_close(d_x, want_x, 3e-2, "grad x")
  for field in ("router", "w_gate", "w_up", "w_down"):
    _assert_close(getattr(d_params, field), getattr(want_params, field), 3e-2, f"grad {field}")
