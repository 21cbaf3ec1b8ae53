"""Mixed precision in the MoE layer, as Flax layers do it: parameters stored in one dtype
(`param_dtype`), computed in the group's (`dtype`), the router in float32, the output in `x`'s
dtype, gradients in each parameter's own dtype. Checked against the dense model with the same
casts (`jax_ep.testing.dense`), and the argument checks that name the layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep.layer import MoEParams
from jax_ep.testing import oracle
from jax_ep.testing.dense import dense_moe_layer
from test_layer import assert_close_to_scale, make_group

F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("group_dtype,param_dtype,x_dtype,mode", [
    (BF16, F32, F32, "high_throughput"),
    (BF16, F32, BF16, "high_throughput"),
    (BF16, F32, F32, "low_latency"),
    (F32, BF16, BF16, "high_throughput"),
])
def test_mixed_precision_matches_the_dense_model(group_dtype, param_dtype, x_dtype, mode):
  """Values and every gradient against the dense model with the same casts; each gradient in
  its parameter's (or x's) dtype."""
  num_ranks, num_experts, num_topk, hidden, ffn, tokens = 4, 16, 4, 64, 32, 8
  group = make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                     max_tokens=tokens, dtype=group_dtype)
  k_p, k_x, k_c = jax.random.split(jax.random.key(5), 3)
  params = jax_ep.init_moe_params(k_p, num_experts=num_experts, hidden=hidden, ffn=ffn,
                                  dtype=param_dtype, shared_ffn=16)
  x = jax.random.normal(k_x, (num_ranks * tokens, hidden), F32).astype(x_dtype)
  cot = jax.random.normal(k_c, x.shape, F32)

  def loss(params, x):
    out = jax_ep.moe_mlp(group, params, x, mode=mode).out
    return jnp.sum(out.astype(F32) * cot), out

  def dense_loss(params, x):
    out = dense_moe_layer(params, x, num_topk, dtype=group_dtype)
    return jnp.sum(out.astype(F32) * cot), out

  (_, out), (g_params, g_x) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  (_, want), (d_params, d_x) = jax.jit(
      jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True))(params, x)
  assert out.dtype == x_dtype
  rel = 3e-2  # bf16 roundings in a different order
  assert_close_to_scale(out, want, rel, "forward")
  assert g_x.dtype == x_dtype
  assert_close_to_scale(g_x, d_x, rel, "grad x")
  for name, g, d, p in zip(MoEParams._fields, g_params, d_params, params):
    if p is None:
      assert g is None and d is None, name
      continue
    assert g.dtype == p.dtype, f"grad {name}: dtype {g.dtype}, parameter {p.dtype}"
    assert_close_to_scale(g, d, rel, f"grad {name}")


def test_nnx_param_dtype_and_dtype():
  """`param_dtype` stores the weights (float32 by default, as in Flax), the compute dtype is the
  group's; a training step runs with float32 weights on a bf16 group."""
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE
  num_ranks, num_experts, num_topk, hidden, ffn, tokens = 2, 8, 2, 32, 16, 8
  group = make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                     max_tokens=tokens, dtype=BF16)
  model = MoE(group, ffn=ffn, rngs=nnx.Rngs(0), dtype=BF16, shared_ffn=8)
  for name in ("router", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down"):
    assert getattr(model, name)[...].dtype == F32, name
  assert MoE(group, ffn=ffn, rngs=nnx.Rngs(0), param_dtype=BF16).w_gate[...].dtype == BF16
  x = jax.random.normal(jax.random.key(1), (num_ranks * tokens, hidden), F32)
  target = jax.random.normal(jax.random.key(2), x.shape, F32)

  out = model(x)
  assert out.dtype == F32
  want = dense_moe_layer(jax.tree.map(np.asarray, model.params), np.asarray(x), num_topk,
                         dtype=BF16)
  assert_close_to_scale(out, want, 3e-2, "nnx forward")

  def loss_fn(model, x, target):
    return jnp.mean((model(x) - target) ** 2)

  @nnx.jit
  def train_step(model, x, target):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, target)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 1.0 * g, params, grads))
    return loss

  loss0 = float(train_step(model, x, target))
  loss1 = float(loss_fn(model, x, target))
  assert np.isfinite(loss0) and loss1 < loss0, f"loss did not go down: {loss0} -> {loss1}"
  assert model.w_gate[...].dtype == F32

  with pytest.raises(ValueError, match=r"jax_ep.nnx.MoE: dtype \(the compute dtype\) is the "
                                       r"group's dtype bfloat16.*got float32.*param_dtype"):
    MoE(group, ffn=ffn, rngs=nnx.Rngs(0), dtype=F32)
  with pytest.raises(TypeError, match="jax_ep.nnx.MoE: param_dtype must be a floating-point "
                                      "dtype, got int32"):
    MoE(group, ffn=ffn, rngs=nnx.Rngs(0), param_dtype=jnp.int32)


def test_unusable_dtypes_name_the_layer_and_the_argument():
  num_ranks, hidden = 2, 32
  group = make_group(num_ranks, num_experts=8, num_topk=2, hidden=hidden, max_tokens=8,
                     dtype=BF16)
  params = jax_ep.init_moe_params(jax.random.key(0), num_experts=8, hidden=hidden, ffn=16,
                                  dtype=F32)
  x = jnp.ones((num_ranks * 8, hidden), F32)
  with pytest.raises(TypeError, match="jax_ep.moe_mlp: x must have a floating-point dtype .*"
                                      "got int32"):
    jax_ep.moe_mlp(group, params, x.astype(jnp.int32))
  with pytest.raises(TypeError, match="jax_ep.moe_mlp: params.w_down must have a "
                                      "floating-point dtype, got int8"):
    jax_ep.moe_mlp(group, params._replace(w_down=params.w_down.astype(jnp.int8)), x)
  with pytest.raises(TypeError, match="jax_ep.moe_mlp: params must be a jax_ep.MoEParams, "
                                      "got dict"):
    jax_ep.moe_mlp(group, params._asdict(), x)

  def per_shard(x):
    return jax_ep.moe_mlp_per_shard(group, params, x).out
  with pytest.raises(TypeError, match="jax_ep.moe_mlp_per_shard: x must have a floating-point"):
    jax.shard_map(per_shard, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep"))(
        group.constrain(x.astype(jnp.int32), P("ep")))


@pytest.mark.parametrize("weights_dtype", [BF16, jnp.float16])
def test_low_latency_combine_takes_half_precision_weights(weights_dtype):
  """bf16 / f16 router weights, as dispatch takes them: the same output as their float32
  values (the oracle's weighted sum), and a weight gradient in their dtype."""
  num_ranks, num_experts, num_topk, hidden, tokens = 4, 8, 3, 32, 5
  group = make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                     max_tokens=tokens, dtype=BF16)
  rng = np.random.default_rng(7)
  x = rng.standard_normal((num_ranks, tokens, hidden)).astype(np.float32)
  idx = rng.integers(-1, num_experts, (num_ranks, tokens, num_topk)).astype(np.int32)
  idx[0, 0] = [2, 2, 5]  # two slots of one expert: one row, the weights summed
  w = rng.random((num_ranks, tokens, num_topk)).astype(np.float32)
  w_half = jnp.asarray(w, weights_dtype)
  slab = num_ranks * tokens
  eo = rng.standard_normal((num_ranks, num_experts // num_ranks, slab, hidden))

  def body(x, idx, w, eo):
    def f(w):
      _, handle = jax_ep.low_latency_dispatch(group, x[0], idx[0])
      return jax_ep.low_latency_combine(group, eo[0], handle, w)
    out, vjp = jax.vjp(f, w[0])
    (g_w,) = vjp(jnp.ones_like(out))
    return out[None], g_w[None]

  sharding = NamedSharding(group.mesh, P("ep"))
  args = [jax.device_put(a, sharding) for a in (jnp.asarray(x, BF16), idx, w_half,
                                                jnp.asarray(eo, BF16))]
  out, g_w = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"),
                                   out_specs=P("ep")))(*args)
  dispatched = oracle.low_latency_dispatch(np.asarray(args[0], np.float32), idx, num_experts,
                                           tokens)
  eo_used = [np.asarray(e, np.float32) for e in np.asarray(args[3], np.float32)]
  want = oracle.low_latency_combine(eo_used, dispatched, np.asarray(w_half, np.float64),
                                    np.float64)
  assert_close_to_scale(out, want, 1e-2, "combine with half-precision weights")
  assert g_w.dtype == weights_dtype
  # d sum(out[t]) / d w[t, k]: the channel sum of the row slot k selects (0 for -1 slots).
  want_g = np.zeros(w.shape)
  for r in range(num_ranks):
    for t in range(tokens):
      for k in range(num_topk):
        if idx[r, t, k] >= 0:
          grad_w = np.zeros(w.shape)
          grad_w[r, t, k] = 1.0
          want_g[r, t, k] = oracle.low_latency_combine(eo_used, dispatched, grad_w,
                                                       np.float64)[r, t].sum()
  assert_close_to_scale(np.asarray(g_w, np.float32), want_g, 2e-2, "weight gradient")
