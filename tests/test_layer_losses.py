"""The load-balancing loss per sequence (Switch / MaxText) and the routing `MoEOutput` exposes
for losses of one's own, against the token-by-token oracle (`jax_ep.testing.oracle`) and
`jax.grad` of the same losses on all tokens at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.layer import param_specs
from jax_ep.routing import route_logits
from jax_ep.testing import oracle
from test_layer import assert_close_to_scale, make_group

F32 = jnp.float32


def test_load_balancing_loss_of_sequences_is_the_mean_of_theirs():
  rng = np.random.default_rng(3)
  logits = rng.standard_normal((3, 10, 8)).astype(np.float32) * 2
  routed = route_logits(logits.reshape(30, 8), 2)
  probs = np.asarray(routed.probs).reshape(3, 10, 8)
  idx = np.array(routed.topk_idx).reshape(3, 10, 2)
  idx[1, :4, 0] = -1  # slots that select nothing still count in their sequence's slots
  want = np.mean([oracle.load_balancing_loss(probs[b], idx[b]) for b in range(3)])
  np.testing.assert_allclose(jax_ep.load_balancing_loss(probs, idx), want, rtol=1e-5)
  np.testing.assert_allclose(jax_ep.load_balancing_loss(probs[None], idx[None]), want, rtol=1e-5)
  with pytest.raises(ValueError, match=r"jax_ep.load_balancing_loss: probs \[..., T, E\] and "
                                       r"topk_idx \[..., T, K\] must agree on their token axes, "
                                       r"got shapes \(3, 10, 8\) and \(30, 2\)"):
    jax_ep.load_balancing_loss(probs, idx.reshape(30, 2))


def _setup(num_ranks, tokens, hidden=32, num_experts=8, num_topk=2, dtype=F32):
  group = make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                     max_tokens=tokens, dtype=dtype)
  k_p, k_x = jax.random.split(jax.random.key(11))
  params = jax_ep.init_moe_params(k_p, num_experts=num_experts, hidden=hidden, ffn=16,
                                  dtype=dtype)
  # A router that prefers some experts, so that the sequences' losses differ.
  params = params._replace(router=params.router * 4)
  x = jax.random.normal(k_x, (num_ranks * tokens, hidden), F32).astype(dtype)
  return group, params, x


def _dense_sequence_loss(router, x, batch, num_topk):
  """The per-sequence loss on all tokens at once, the loss differentiable in the router."""
  routed = route_logits(x.astype(F32) @ router, num_topk)
  seq = x.shape[0] // batch
  return jax_ep.load_balancing_loss(routed.probs.reshape(batch, seq, -1),
                                    routed.topk_idx.reshape(batch, seq, -1))


@pytest.mark.parametrize("num_ranks,tokens,batch", [
    (4, 8, 8),   # 2 whole sequences per shard: no communication
    (4, 8, 2),   # a sequence over 2 shards
    (4, 6, 6),   # sequences of 4 cut by shards of 6 tokens
    (4, 6, 1),   # one sequence over every shard
])
def test_per_sequence_aux_loss_matches_the_oracle(num_ranks, tokens, batch):
  """Wherever the shards cut the sequences: the mean over shards is the mean over sequences of
  each one's loss, and so is its gradient w.r.t. the router."""
  group, params, x = _setup(num_ranks, tokens)
  seq = num_ranks * tokens // batch
  xs = x.reshape(batch, seq, -1)

  def aux(router, xs):
    result = jax_ep.moe_mlp(group, params._replace(router=router), xs,
                            aux_loss_scope="per_sequence")
    return jnp.mean(result.aux_loss), result

  (value, result), grad = jax.jit(jax.value_and_grad(aux, has_aux=True))(params.router, xs)
  assert result.aux_loss.shape == (num_ranks,)
  assert result.out.shape == xs.shape and result.router_probs.shape == (batch, seq, 8)
  probs = np.asarray(result.router_probs, np.float64)
  idx = np.asarray(result.topk_idx)
  per_sequence = [oracle.load_balancing_loss(probs[b], idx[b]) for b in range(batch)]
  np.testing.assert_allclose(value, np.mean(per_sequence), rtol=1e-5)
  if batch > 1:  # the form matters: it is not the loss of all tokens at once
    whole = oracle.load_balancing_loss(probs.reshape(-1, 8), idx.reshape(-1, 2))
    assert abs(np.mean(per_sequence) - whole) > 1e-3
  want = jax.jit(jax.grad(_dense_sequence_loss), static_argnums=(2, 3))(params.router, x, batch,
                                                                        2)
  assert_close_to_scale(grad, want, 1e-4, "grad router")


def test_per_sequence_in_the_per_shard_body():
  """`moe_mlp_per_shard` with `[b, S, H]` whole sequences: each shard's own sequences."""
  num_ranks, tokens = 2, 8
  group, params, x = _setup(num_ranks, tokens)
  xs = group.constrain(x.reshape(num_ranks * 4, 2, -1), P("ep"))

  specs = param_specs("ep", params)
  params = jax_ep.MoEParams(*(None if p is None else group.constrain(p, s)
                              for p, s in zip(params, specs)))

  def body(params, xs):
    result = jax_ep.moe_mlp_per_shard(group, params, xs, aux_loss_scope="per_sequence")
    return result.out, result.aux_loss[None], result.router_probs, result.topk_idx

  out, aux, probs, idx = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(specs, P("ep")),
                                               out_specs=P("ep")))(params, xs)
  assert out.shape == xs.shape and probs.shape == (8, 2, 8) and idx.shape == (8, 2, 2)
  probs, idx, aux = np.asarray(probs, np.float64), np.asarray(idx), np.asarray(aux)
  for r in range(num_ranks):
    mine = range(4 * r, 4 * r + 4)
    want = np.mean([oracle.load_balancing_loss(probs[b], idx[b]) for b in mine])
    np.testing.assert_allclose(aux[r], want, rtol=1e-5)


def test_moe_output_exposes_the_routing():
  """`router_probs`, `topk_idx` and `topk_weights` shaped like the tokens, equal to the router on
  all tokens; a loss of one's own through `router_probs` has the dense model's gradient."""
  num_ranks, tokens, batch = 4, 8, 4
  group, params, x = _setup(num_ranks, tokens)
  xs = x.reshape(batch, -1, x.shape[-1])
  result = jax.jit(lambda p, xs: jax_ep.moe_mlp(group, p, xs))(params, xs)
  # New fields come after the old five: code that indexes or slices the tuple keeps working.
  assert jax_ep.MoEOutput._fields == ("out", "num_dropped", "aux_loss", "z_loss",
                                      "expert_counts", "router_probs", "topk_idx",
                                      "topk_weights", "num_invalid")
  routed = route_logits(x @ params.router, 2)
  assert result.router_probs.shape == (batch, 8, 8) and result.router_probs.dtype == F32
  assert result.topk_idx.shape == (batch, 8, 2) and result.topk_idx.dtype == jnp.int32
  assert result.topk_weights.shape == (batch, 8, 2) and result.topk_weights.dtype == F32
  np.testing.assert_allclose(result.router_probs.reshape(-1, 8), routed.probs, rtol=1e-5,
                             atol=1e-7)
  np.testing.assert_array_equal(result.topk_idx.reshape(-1, 2), routed.topk_idx)
  np.testing.assert_allclose(result.topk_weights.reshape(-1, 2), routed.topk_weights, rtol=1e-5)

  def own_loss(router):  # e.g. an entropy bonus
    probs = jax_ep.moe_mlp(group, params._replace(router=router), xs).router_probs
    return -jnp.mean(jnp.sum(probs * jnp.log(probs), axis=-1))

  def dense_own_loss(router):
    probs = route_logits(x @ router, 2).probs
    return -jnp.mean(jnp.sum(probs * jnp.log(probs), axis=-1))
  assert_close_to_scale(jax.jit(jax.grad(own_loss))(params.router),
                        jax.grad(dense_own_loss)(params.router), 1e-4, "grad router")

  # Given routing: no router ran, the routing comes back as given.
  given = jax.jit(lambda p, x, i, w: jax_ep.moe_mlp(group, p, x, i, w))(
      params, x, routed.topk_idx, routed.topk_weights.astype(jnp.bfloat16))
  assert given.router_probs is None
  np.testing.assert_array_equal(given.topk_idx, routed.topk_idx)
  assert given.topk_weights.dtype == jnp.bfloat16
  np.testing.assert_array_equal(given.aux_loss, 0)


def test_nnx_per_sequence_and_whole_output():
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE
  num_ranks, tokens = 2, 8
  group, _, x = _setup(num_ranks, tokens)
  model = MoE(group, ffn=16, rngs=nnx.Rngs(0), aux_loss_scope="per_sequence")
  xs = x.reshape(1, -1, x.shape[-1])  # one sequence over both shards
  result = model(xs, return_output=True)
  assert isinstance(result, jax_ep.MoEOutput) and result.out.shape == xs.shape
  want = oracle.load_balancing_loss(np.asarray(result.router_probs[0], np.float64),
                                    np.asarray(result.topk_idx[0]))
  np.testing.assert_allclose(np.mean(model.aux_loss[...]), want, rtol=1e-5)
  with pytest.raises(ValueError, match=r"jax_ep.moe_mlp: aux_loss_scope='per_sequence' needs x "
                                       r"as \[B, S, H\]"):
    model(x)
  with pytest.raises(TypeError, match="jax_ep.nnx.MoE: return_output must be a bool"):
    model(xs, return_output="yes")


def test_given_ids_outside_the_experts_are_counted():
  """Ids the caller gives outside `[-1, E)` route nowhere, as in `dispatch`, and the layer
  counts them per shard in `num_invalid` (the router never makes one: 0 there)."""
  num_ranks, tokens = 4, 8
  group, params, x = _setup(num_ranks, tokens)
  result = jax.jit(lambda p, x: jax_ep.moe_mlp(group, p, x))(params, x)
  np.testing.assert_array_equal(np.asarray(result.num_invalid), [0] * num_ranks)
  idx = np.tile(np.array([[0, 1]], np.int32), (x.shape[0], 1))
  idx[0, 1] = 8            # shard 0: E itself
  idx[tokens + 3, 0] = -2  # shard 1
  idx[tokens + 4, :] = [9, 40]
  idx[2 * tokens, 0] = -1  # shard 2: -1 routes nowhere and is not invalid
  w = np.full(idx.shape, 0.5, np.float32)
  result = jax.jit(lambda p, x, i, w: jax_ep.moe_mlp(group, p, x, i, w))(
      params, x, jnp.asarray(idx), jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(result.num_invalid), [1, 3, 0, 0])
