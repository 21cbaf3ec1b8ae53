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


def _host_inputs(num_experts, hidden, ffn, tokens, seed=0):
  """Host (numpy) params, x and the output cotangent, the same in every process."""
  params = jax_ep.init_moe_params(jax.random.key(seed), num_experts=num_experts, hidden=hidden,
                                  ffn=ffn, dtype=jnp.bfloat16)
  params = MoEParams(*(None if p is None else np.asarray(p) for p in params))
  rng = np.random.default_rng(seed)
  x = np.asarray(jnp.asarray(rng.standard_normal((tokens, hidden), np.float32), jnp.bfloat16))
  cot = rng.standard_normal((tokens, hidden)).astype(np.float32)
  return params, x, cot


def _global(mesh, array, spec):
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(array.shape, sharding, lambda i: array[i])


def _local_rows(value):
  """`{row slice start: numpy block}` of the shards this process holds (rows = axis 0)."""
  return {(s.index[0].start or 0): np.asarray(s.data, np.float64)
          for s in value.addressable_shards}


def _assert_close(got, want, rel, what):
  """Each held shard of `got` (`_local_rows`) against the same rows of the dense `want` (to the
  scale of the whole `want`)."""
  want = np.asarray(want, np.float64)
  scale = np.abs(want).max()
  assert scale > 0, f"{what}: the dense reference is all zero"
  for start, block in got.items():
    ref = want[start:start + block.shape[0]]
    assert np.isfinite(block).all(), f"{what}: not finite"
    err = np.abs(block - ref).max()
    assert err <= rel * scale, f"{what}: max abs err {err:.3e} > {rel:g} * {scale:.3e}"


def _dense(params, x, cot, num_topk):
  """The dense model on this process's first device, computing in bf16 like the layer: output
  and gradients (params, x)."""
  device = jax.local_devices()[0]
  params, x, cot = jax.device_put((params, x, cot), device)

  def loss(params, x):
    out = dense_moe_layer(params, x, num_topk, dtype=jnp.bfloat16)
    return jnp.sum(out.astype(jnp.float32) * cot), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return jax.tree.map(np.asarray, (out, grads))


@pytest.mark.parametrize("name", list(SHAPES))
def test_moe_mlp_trains_at_model_shapes(name):
  mesh, num_ranks = _mesh()
  e, h, f, k = _shape(name, num_ranks)
  params, x, cot = _host_inputs(e, h, f, num_ranks * TOKENS)
  with jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h,
                    max_tokens_per_rank=TOKENS, dtype=jnp.bfloat16) as group:
    assert group.backend_name == "cuda", group.backend_reason
    g_params = MoEParams(*(None if p is None else _global(mesh, p, s) for p, s in
                           zip(params, jax_ep.layer.param_specs("ep", params))))
    g_x, g_cot = _global(mesh, x, P("ep")), _global(mesh, cot, P("ep"))

    def loss(params, x, cot):
      result = jax_ep.moe_mlp(group, params, x)
      return jnp.sum(result.out.astype(jnp.float32) * cot), result
    (_, result), (d_params, d_x) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(g_params, g_x, g_cot)
    jax.block_until_ready(d_x)
    group.check()
    fields = ("router", "w_gate", "w_up", "w_down")
    for field in fields:
      assert getattr(d_params, field).dtype == getattr(params, field).dtype, f"grad {field}"
    # To the host before the dense twin takes the device's memory.
    got = {"out": _local_rows(result.out), "grad x": _local_rows(d_x),
           **{f"grad {f}": _local_rows(getattr(d_params, f)) for f in fields}}
    dropped = [int(np.asarray(s.data).sum()) for s in result.num_dropped.addressable_shards]
    del result, d_params, d_x, g_params
  assert dropped and not any(dropped)
  want_out, (want_params, want_x) = _dense(params, x, cot, k)
  _assert_close(got["out"], want_out, 3e-2, "out")
  _assert_close(got["grad x"], want_x, 3e-2, "grad x")
  for field in fields:
    _assert_close(got[f"grad {field}"], getattr(want_params, field), 3e-2, f"grad {field}")


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
  _, x, cot = _host_inputs(e, h, f, num_ranks * TOKENS, seed=1)
  # The module draws its weights from rngs.params() exactly so; every process draws the same.
  params = jax_ep.init_moe_params(nnx.Rngs(0).params(), num_experts=e, hidden=h, ffn=f,
                                  dtype=param_dtype)
  params = MoEParams(*(None if p is None else np.asarray(p) for p in params))
  with jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h,
                    max_tokens_per_rank=TOKENS, dtype=jnp.bfloat16) as group:
    model = MoE(group, ffn=f, rngs=nnx.Rngs(0), param_dtype=param_dtype)
    g_x, g_cot = _global(mesh, x, P("ep")), _global(mesh, cot, P("ep"))

    @nnx.jit
    def step(model, x, cot):
      def loss(model, x):
        return jnp.sum(model(x).astype(jnp.float32) * cot)
      return nnx.grad(loss, argnums=(0, 1))(model, x)
    d_model, d_x = step(model, g_x, g_cot)
    jax.block_until_ready(d_x)
    group.check()
    for start, block in _local_rows(model.w_gate[...]).items():  # the module drew these weights
      np.testing.assert_array_equal(block, params.w_gate[start:start + block.shape[0]])
    fields = ("w_gate", "w_down")
    for field in fields:
      assert getattr(d_model, field)[...].dtype == param_dtype, f"grad {field}"
    got = {"grad x": _local_rows(d_x),
           **{f: _local_rows(getattr(d_model, f)[...]) for f in fields}}
    del d_model, d_x, model
  _, (want_params, want_x) = _dense(params, x, cot, k)
  _assert_close(got["grad x"], want_x, 3e-2, "grad x")
  for field in fields:
    _assert_close(got[field], getattr(want_params, field), 3e-2, f"grad {field}")
