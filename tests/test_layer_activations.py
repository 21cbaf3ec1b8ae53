"""The experts' activations (SwiGLU, GeGLU, GELU, SiLU) and `remat` in the MoE layer, against the
dense model (`jax_ep.testing.dense`): values and gradients w.r.t. x, the router and every
weight."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import jax_ep
from jax_ep.layer import MoEParams
from jax_ep.mlp import ACTIVATIONS, expert_mlp
from jax_ep.testing.dense import dense_moe_layer
from test_layer import assert_close_to_scale, make_group

F32 = jnp.float32


def _case(activation, *, num_ranks=4, num_experts=16, num_topk=4, hidden=32, ffn=16, tokens=8,
          dtype=F32, shared_ffn=8, seed=0):
  group = make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                     max_tokens=tokens, dtype=dtype)
  k_p, k_x, k_c = jax.random.split(jax.random.key(seed), 3)
  params = jax_ep.init_moe_params(k_p, num_experts=num_experts, hidden=hidden, ffn=ffn,
                                  dtype=dtype, shared_ffn=shared_ffn, activation=activation)
  x = jax.random.normal(k_x, (num_ranks * tokens, hidden), F32).astype(dtype)
  cot = jax.random.normal(k_c, x.shape, F32)
  return group, params, x, cot


def _grads(fn, params, x, cot):
  def loss(params, x):
    out = fn(params, x)
    return jnp.sum(out.astype(F32) * cot), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, grads


def _assert_grads_close(got, want, rel, what):
  (g_params, g_x), (d_params, d_x) = got, want
  assert_close_to_scale(g_x, d_x, rel, f"{what}: grad x")
  for name, g, d in zip(MoEParams._fields, g_params, d_params):
    assert (g is None) == (d is None), name
    if g is not None:
      assert_close_to_scale(g, d, rel, f"{what}: grad {name}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_each_activation_matches_the_dense_model(activation):
  group, params, x, cot = _case(activation)
  gated = activation in ("swiglu", "geglu")
  assert (params.w_up is not None) == gated and (params.shared_up is not None) == gated
  layer = lambda p, x: jax_ep.moe_mlp(group, p, x, activation=activation).out  # noqa: E731
  dense = lambda p, x: dense_moe_layer(p, x, group.num_topk, activation=activation)  # noqa: E731
  out, grads = _grads(layer, params, x, cot)
  want, dense_grads = _grads(dense, params, x, cot)
  assert_close_to_scale(out, want, 1e-4, f"{activation} forward")
  _assert_grads_close(grads, dense_grads, 1e-4, activation)


def test_activations_differ_from_each_other():
  """The dense model's activations are four different functions (a test of the tests: a
  layer that ignored `activation` would otherwise pass)."""
  x = jax.random.normal(jax.random.key(1), (16, 32), F32)
  outs = {}
  for activation in ACTIVATIONS:
    params = jax_ep.init_moe_params(jax.random.key(0), num_experts=4, hidden=32, ffn=16,
                                    dtype=F32, activation=activation)
    outs[activation] = np.asarray(dense_moe_layer(params, x, 2, activation=activation))
  for i, a in enumerate(ACTIVATIONS):
    for b in ACTIVATIONS[i + 1:]:
      assert np.abs(outs[a] - outs[b]).max() > 1e-3, (a, b)


def test_expert_mlp_checks_the_up_projection():
  x = jnp.ones((8, 16), F32)
  w = jnp.ones((2, 16, 4), F32)
  w_down = jnp.ones((2, 4, 16), F32)
  sizes = jnp.array([3, 5], jnp.int32)
  with pytest.raises(ValueError, match=r"jax_ep.expert_mlp: activation='gelu' is a two-matrix "
                                       r"MLP with no up projection: w_up must be None"):
    expert_mlp(x, w, w, w_down, sizes, activation="gelu")
  with pytest.raises(ValueError, match=r"jax_ep.expert_mlp: activation='geglu' is gated and "
                                       r"needs w_up, got None"):
    expert_mlp(x, w, None, w_down, sizes, activation="geglu")
  with pytest.raises(ValueError, match=r"jax_ep.expert_mlp: activation must be one of 'swiglu', "
                                       r"'geglu', 'gelu', 'silu', got 'relu'"):
    expert_mlp(x, w, None, w_down, sizes, activation="relu")
  with pytest.raises(ValueError, match=r"jax_ep.init_moe_params: activation must be one of"):
    jax_ep.init_moe_params(jax.random.key(0), num_experts=2, hidden=16, ffn=4, activation="glu")


def test_layer_options_are_checked():
  group, params, x, _ = _case("swiglu", num_ranks=2)
  plain = params._replace(w_up=None, shared_up=None)
  cases = [
      (dict(activation="relu"), ValueError, r"jax_ep.moe_mlp: activation must be one of"),
      (dict(mode="decode"), ValueError, r"jax_ep.moe_mlp: mode must be 'high_throughput' or "
                                        r"'low_latency', got 'decode'"),
      (dict(aux_loss_scope="per_batch"), ValueError,
       r"jax_ep.moe_mlp: aux_loss_scope must be 'per_shard' or 'per_sequence', got "
       r"'per_batch'"),
      (dict(remat="yes"), TypeError, r"jax_ep.moe_mlp: remat must be a bool, got 'yes'"),
      (dict(aux_loss_scope="per_sequence"), ValueError,
       r"jax_ep.moe_mlp: aux_loss_scope='per_sequence' needs x as \[B, S, H\] sequences, got "
       r"shape \(16, 32\)"),
      (dict(activation="gelu"), ValueError,
       r"jax_ep.moe_mlp: activation='gelu' is a two-matrix MLP with no up projection: "
       r"params.w_up must be None, got an array of shape \(16, 32, 16\)"),
      (dict(activation="geglu", mode="low_latency"), NotImplementedError,
       r"jax_ep.moe_mlp: activation='geglu' with mode='low_latency': the experts on the decode "
       r"slabs \(expert_mlp_slabs\) are SwiGLU only"),
  ]
  for kwargs, error, message in cases:
    with pytest.raises(error, match=message):
      jax_ep.moe_mlp(group, params, x, **kwargs)
  with pytest.raises(ValueError, match=r"jax_ep.moe_mlp: activation='swiglu' is gated and needs "
                                       r"params.w_up, got None"):
    jax_ep.moe_mlp(group, plain, x)
  with pytest.raises(ValueError, match=r"activation='silu' is a two-matrix MLP.*params.shared_up "
                                       r"must be None"):
    jax_ep.moe_mlp(group, plain._replace(shared_up=params.shared_up), x, activation="silu")


def _residual_shapes(fn, *args):
  """The shapes `jax.ad_checkpoint.print_saved_residuals` lists (global, shard counts dropped)."""
  import contextlib
  import io
  buffer = io.StringIO()
  with contextlib.redirect_stdout(buffer):
    print_saved_residuals(fn, *args)
  shapes = []
  for line in buffer.getvalue().splitlines():
    match = re.match(r"\w+\[([\d@\w,]*)\]", line)
    if match:
      shapes.append(tuple(int(d.split("@")[0]) for d in match.group(1).split(",") if d))
  return shapes


@pytest.mark.parametrize("mode,activation", [("high_throughput", "swiglu"),
                                             ("high_throughput", "gelu"),
                                             ("low_latency", "swiglu")])
def test_remat_keeps_the_gradients_and_saves_only_the_inputs(mode, activation):
  group, params, x, cot = _case(activation, seed=1)
  idx, w = jax_ep.route(x, params.router, group.num_topk)

  def layer(remat, routed):
    def fn(p, x):
      routing = (idx, w) if routed else ()
      return jax_ep.moe_mlp(group, p, x, *routing, mode=mode, activation=activation,
                            remat=remat).out
    return fn
  out, grads = _grads(layer(False, False), params, x, cot)
  out_remat, grads_remat = _grads(layer(True, False), params, x, cot)
  assert_close_to_scale(out_remat, out, 1e-6, "remat forward")
  _assert_grads_close(grads_remat, grads, 1e-5, "remat")
  want, dense_grads = _grads(
      lambda p, x: dense_moe_layer(p, x, group.num_topk, activation=activation), params, x, cot)
  _assert_grads_close(grads_remat, dense_grads, 1e-4, "remat vs dense")

  # With the routing given, what the backward keeps is the layer's input, the routing and the
  # weights as stored; without remat, the dispatched rows and hidden activations too.
  loss = lambda fn: lambda p, x: jnp.sum(fn(p, x) * cot)  # noqa: E731
  inputs = {x.shape, idx.shape} | {p.shape for p in params if p is not None}
  kept = set(_residual_shapes(loss(layer(True, True)), params, x))
  assert kept <= inputs | {cot.shape}, f"remat saved {kept - inputs}"
  assert set(_residual_shapes(loss(layer(False, True)), params, x)) - inputs - {cot.shape}


def test_nnx_activation_and_remat():
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE
  group, _, x, cot = _case("geglu", num_ranks=2)
  model = MoE(group, ffn=16, rngs=nnx.Rngs(0), activation="gelu", remat=True, shared_ffn=8)
  assert model.w_up is None and model.shared_up is None
  assert model.params.w_up is None

  def loss_fn(model, x):
    return jnp.sum(model(x) * cot)
  loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, x)
  params = jax.tree.map(np.asarray, model.params)
  want, (dense_grads, _) = _grads(
      lambda p, x: dense_moe_layer(p, x, group.num_topk, activation="gelu"), params, x, cot)
  np.testing.assert_allclose(loss, jnp.sum(want * cot), rtol=1e-4)
  for name in ("router", "w_gate", "w_down", "shared_gate", "shared_down"):
    assert_close_to_scale(grads[name][...], getattr(dense_grads, name), 1e-4, f"nnx {name}")
  with pytest.raises(NotImplementedError, match="jax_ep.nnx.MoE: activation='silu' with "
                                                "mode='low_latency'"):
    MoE(group, ffn=16, rngs=nnx.Rngs(0), activation="silu", mode="low_latency")
