"""Routers, auxiliary losses and the layer's options against independent dense implementations
(`jax_ep.testing.oracle`'s token-by-token numpy router, `jax_ep.testing.dense`'s every-expert
model), on the CPU's 8 host devices."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep.testing import oracle
from jax_ep.testing.dense import dense_moe
from test_layer import assert_close_to_scale, make_group

ROUTINGS = {
    "softmax": jax_ep.Routing(),
    "softmax_unnormalised": jax_ep.Routing(renormalize=False),
    "sigmoid_deepseek": jax_ep.Routing(score="sigmoid", num_groups=4, topk_groups=2,
                                       routed_scaling_factor=2.5),
    "sigmoid_plain": jax_ep.Routing(score="sigmoid", renormalize=False),
}


def _oracle_route(logits, k, routing, bias=None):
  return oracle.route(logits, k, score=routing.score, renormalize=routing.renormalize,
                      bias=bias, num_groups=routing.num_groups,
                      topk_groups=routing.topk_groups,
                      routed_scaling_factor=routing.routed_scaling_factor)


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_route_matches_the_token_by_token_router(name, with_bias):
  routing = ROUTINGS[name]
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((64, 16)).astype(np.float32)
  bias = (0.3 * rng.standard_normal(16)).astype(np.float32) if with_bias else None
  routed = jax.jit(lambda l, b: jax_ep.routing.route_logits(l, 4, routing, b))(logits, bias)
  idx, weights, probs = _oracle_route(logits, 4, routing, bias)
  np.testing.assert_array_equal(np.sort(routed.topk_idx, axis=1), np.sort(idx, axis=1))
  order = np.argsort(routed.topk_idx, axis=1)
  np.testing.assert_allclose(np.take_along_axis(routed.topk_weights, order, 1),
                             np.take_along_axis(weights, np.argsort(idx, axis=1), 1),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(routed.probs, probs, rtol=1e-5, atol=1e-7)
  if routing.num_groups > 1:  # every token's experts lie in at most topk_groups groups
    groups = np.asarray(routed.topk_idx) // (16 // routing.num_groups)
    assert max(len(set(g)) for g in groups) <= routing.topk_groups


def test_bias_chooses_but_does_not_weigh():
  logits = np.zeros((1, 8), np.float32)
  logits[0, :4] = [3.0, 2.0, 1.0, 0.5]
  bias = np.zeros(8, np.float32)
  bias[7] = 10.0  # expert 7 is chosen for its bias, weighted by its own (low) score
  routed = jax_ep.routing.route_logits(logits, 2, jax_ep.Routing(score="sigmoid",
                                                                 renormalize=False), bias)
  assert sorted(np.asarray(routed.topk_idx)[0].tolist()) == [0, 7]
  np.testing.assert_allclose(sorted(np.asarray(routed.topk_weights)[0]),
                             sorted([1 / (1 + np.exp(-3.0)), 0.5]), rtol=1e-6)


def test_auxiliary_losses_match_the_oracle():
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((40, 8)).astype(np.float32) * 2
  for routing in ROUTINGS.values():
    if routing.num_groups > 1:
      continue
    routed = jax_ep.routing.route_logits(logits, 2, routing)
    want = oracle.load_balancing_loss(_oracle_route(logits, 2, routing)[2], routed.topk_idx)
    np.testing.assert_allclose(jax_ep.load_balancing_loss(routed.probs, routed.topk_idx), want,
                               rtol=1e-5)
  np.testing.assert_allclose(jax_ep.router_z_loss(logits), oracle.router_z_loss(logits),
                             rtol=1e-5)
  # Perfect balance gives 1.
  uniform = jnp.full((8, 4), 0.25)
  np.testing.assert_allclose(
      jax_ep.load_balancing_loss(uniform, jnp.arange(8, dtype=jnp.int32)[:, None] % 4), 1.0)


def test_update_router_bias_moves_towards_balance():
  bias = jnp.zeros(4)
  counts = jnp.array([[10, 0, 5, 5], [10, 2, 5, 3]])
  new = jax_ep.update_router_bias(bias, counts, rate=0.1)
  np.testing.assert_allclose(new, [-0.1, 0.1, 0.0, 0.1])  # sums 20, 2, 10, 8; mean 10


# ------------------------------------------------------------------------- the layer's options

def _layer_inputs(num_tokens, hidden, num_experts, ffn, dtype=jnp.float32, **init):
  k_p, k_x, k_c = jax.random.split(jax.random.key(3), 3)
  params = jax_ep.init_moe_params(k_p, num_experts=num_experts, hidden=hidden, ffn=ffn,
                                  dtype=dtype, **init)
  x = jax.random.normal(k_x, (num_tokens, hidden), jnp.float32).astype(dtype)
  return params, x


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_moe_mlp_with_each_routing_matches_the_dense_model(name):
  routing = ROUTINGS[name]
  num_ranks, tokens, hidden, num_experts, ffn = 4, 8, 32, 16, 16
  group = make_group(num_ranks, num_experts=num_experts, num_topk=4, hidden=hidden,
                     max_tokens=tokens, dtype=jnp.float32)
  params, x = _layer_inputs(num_ranks * tokens, hidden, num_experts, ffn, router_bias=True)
  params = params._replace(router_bias=jnp.linspace(-0.2, 0.2, num_experts))
  result = jax.jit(lambda p, x: jax_ep.moe_mlp(group, p, x, routing=routing))(params, x)
  result = jax.tree.map(np.asarray, result)
  logits = np.asarray(x, np.float64) @ np.asarray(params.router, np.float64)
  idx, weights, probs = _oracle_route(logits, 4, routing, np.asarray(params.router_bias))
  want = dense_moe(params, x, jnp.asarray(idx), jnp.asarray(weights, jnp.float32))
  assert_close_to_scale(result.out, want, 1e-4, f"{name} forward")
  # Per shard of tokens: the losses and counts of its own tokens.
  for r in range(num_ranks):
    rows = slice(r * tokens, (r + 1) * tokens)
    np.testing.assert_allclose(result.aux_loss[r],
                               oracle.load_balancing_loss(probs[rows], idx[rows]), rtol=1e-4)
    np.testing.assert_allclose(result.z_loss[r], oracle.router_z_loss(logits[rows]), rtol=1e-4)
    np.testing.assert_array_equal(result.expert_counts[r],
                                  np.bincount(idx[rows].reshape(-1), minlength=num_experts))


def test_shared_expert_and_batched_tokens():
  """A shared expert beside the routed ones, and tokens given as [B, S, H]."""
  num_ranks, tokens, hidden, num_experts, ffn = 2, 8, 32, 8, 16
  group = make_group(num_ranks, num_experts=num_experts, num_topk=2, hidden=hidden,
                     max_tokens=tokens, dtype=jnp.float32)
  params, x = _layer_inputs(num_ranks * tokens, hidden, num_experts, ffn, shared_ffn=24)
  cot = jax.random.normal(jax.random.key(9), x.shape)

  def loss(params, x):
    out = jax_ep.moe_mlp(group, params, x.reshape(2, -1, hidden)).out
    assert out.shape == (2, num_ranks * tokens // 2, hidden)
    return jnp.sum(out.reshape(x.shape) * cot)

  def dense_loss(params, x):
    idx, w = jax_ep.route(x, params.router, 2)
    return jnp.sum(dense_moe(params, x, idx, w) * cot)
  got = jax.jit(jax.value_and_grad(loss, (0, 1)))(params, x)
  want = jax.jit(jax.value_and_grad(dense_loss, (0, 1)))(params, x)
  assert_close_to_scale(got[0], want[0], 1e-4, "loss")
  for name in ("shared_gate", "shared_up", "shared_down", "w_gate", "router"):
    assert_close_to_scale(getattr(got[1][0], name), getattr(want[1][0], name), 1e-4, name)
  assert_close_to_scale(got[1][1], want[1][1], 1e-4, "grad x")


def test_data_axis_beside_the_expert_axis():
  """A ('dp', 'ep') mesh: tokens split over both axes, experts over 'ep' (replicated over 'dp'):
  every data replica runs its own tokens; values and expert gradients match the dense model."""
  if jax.process_count() > 1 or jax.device_count() < 8:
    pytest.skip("needs 8 devices in one process")
  mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=jax.devices()[:8])
  tokens, hidden, num_experts, ffn = 6, 32, 8, 16
  group = jax_ep.Group(mesh, "ep", num_experts=num_experts, num_topk=2, hidden=hidden,
                       max_tokens_per_rank=tokens, dtype=jnp.float32)
  assert group.backend_name == "reference"
  params, x = _layer_inputs(8 * tokens, hidden, num_experts, ffn)
  cot = jax.random.normal(jax.random.key(4), x.shape)

  def loss(params, x):
    return jnp.sum(jax_ep.moe_mlp(group, params, x).out * cot)

  def dense_loss(params, x):
    idx, w = jax_ep.route(x, params.router, 2)
    return jnp.sum(dense_moe(params, x, idx, w) * cot)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(loss, (0, 1)))(params, x)
  want = jax.jit(jax.value_and_grad(dense_loss, (0, 1)))(params, x)
  assert_close_to_scale(got[0], want[0], 1e-4, "loss")
  assert_close_to_scale(got[1][1], want[1][1], 1e-4, "grad x")
  for name in ("w_gate", "w_up", "w_down", "router"):
    assert_close_to_scale(getattr(got[1][0], name), getattr(want[1][0], name), 1e-4, name)


def test_bf16_router_weights_are_accepted():
  num_ranks, tokens, hidden = 2, 5, 32
  group = make_group(num_ranks, num_experts=8, num_topk=2, hidden=hidden, max_tokens=tokens,
                     dtype=jnp.float32)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((num_ranks, tokens, hidden)), jnp.float32)
  idx = jnp.asarray(np.stack([[rng.permutation(8)[:2] for _ in range(tokens)]
                              for _ in range(num_ranks)]), jnp.int32)
  w = jnp.asarray(rng.random((num_ranks, tokens, 2)), jnp.bfloat16)
  eo = jnp.asarray(rng.standard_normal((num_ranks, group.capacity, hidden)), jnp.float32)

  def body(x, idx, w, eo):
    def f(w):
      recv, handle = jax_ep.dispatch(group, x[0], idx[0], w)
      return jnp.sum(jax_ep.combine(group, eo[0], handle))
    value, grad = jax.value_and_grad(f)(w[0])
    return value[None], grad[None]
  sharding = NamedSharding(group.mesh, P("ep"))
  args = [jax.device_put(a, sharding) for a in (x, idx, w, eo)]
  value, grad = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"),
                                      out_specs=P("ep")))(*args)
  assert grad.dtype == jnp.bfloat16 and np.isfinite(np.asarray(value)).all()


def test_nnx_module_options():
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE
  num_ranks, tokens, hidden = 2, 8, 32
  group = make_group(num_ranks, num_experts=8, num_topk=2, hidden=hidden, max_tokens=tokens,
                     dtype=jnp.float32)
  model = MoE(group, ffn=16, rngs=nnx.Rngs(0), routing=jax_ep.Routing(score="sigmoid"),
              router_bias=True, shared_ffn=16)
  x = jax.random.normal(jax.random.key(1), (num_ranks * tokens, hidden))
  out = model(x)
  assert out.shape == x.shape
  counts = np.asarray(model.expert_counts[...])
  assert counts.shape == (num_ranks, 8) and counts.sum() == num_ranks * tokens * 2
  assert np.asarray(model.aux_loss[...]).shape == (num_ranks,)
  before = np.asarray(model.bias[...]).copy()
  model.update_bias(rate=0.5)
  assert not np.allclose(before, model.bias[...])
  # The bias is not a parameter: nnx.grad gives it no gradient.
  grads = nnx.jit(nnx.grad(lambda m, x: jnp.mean(m(x) ** 2)))(model, x)
  assert "bias" not in nnx.to_pure_dict(grads)


def test_nnx_without_flax_says_what_to_install():
  code = "import sys; sys.modules['flax'] = None; import jax_ep.nnx"
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  assert result.returncode != 0
  assert "jax_ep.nnx needs flax: pip install 'jax_ep[nnx]'" in result.stderr
