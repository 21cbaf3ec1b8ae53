"""`jax_ep.nnx.MoE` in Flax's own recipes: built under `nnx.vmap`, run under `nnx.scan` over
layers with `nnx.remat` and `nnx.jit` on a ('data', 'expert') mesh of Auto or Explicit axes,
compiled once; inside `jax.lax` loops; statistics switched off; one module for training and
decode; the errors of a wrong call; a strict group that failed refuses every new trace.

The oracle is the dense layer (`jax_ep.testing.dense.dense_moe_layer`: every expert on every
token, no sharding, no communication) applied to each layer's weights in turn.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jax_ep
from jax_ep.layer import MoEParams
from jax_ep.testing.dense import dense_moe_layer

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
from jax_ep.nnx import MoE, MoEStats  # noqa: E402

pytestmark = pytest.mark.skipif(
    jax.process_count() > 1 or jax.device_count() < 8,
    reason="compares whole global arrays on a mesh of 8 devices in one process")

H, E, K, F, LAYERS, TOKENS = 16, 8, 2, 8, 2, 8  # TOKENS: max_tokens_per_rank of training
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_lowerings: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *_, **__: _lowerings.append(event) if event == _LOWER else None)


def _mesh(axis_type):
  return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(axis_type,) * 2)


def _group(mesh, max_tokens=TOKENS, **options):
  return jax_ep.Group(mesh, "expert", num_experts=E, num_topk=K, hidden=H,
                      max_tokens_per_rank=max_tokens, dtype=jnp.float32, backend="reference",
                      **options)


class Block(nnx.Module):
  def __init__(self, group, rngs, **options):
    self.moe = MoE(group, ffn=F, rngs=rngs, **options)

  def __call__(self, x):
    return x + self.moe(x)


class Stack(nnx.Module):
  """Flax's scan-over-layers recipe: the blocks built under `nnx.vmap`, run under `nnx.scan`,
  each block rematerialised."""

  def __init__(self, group, rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def blocks(rngs):
      return Block(group, rngs)
    self.blocks = blocks(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, block):
      return block(x)
    return body(x, self.blocks)


def _layer_params(stack, layer):
  moe = stack.blocks.moe
  return MoEParams(*(None if p is None else np.asarray(p)[layer] for p in moe.params))


def _dense_stack(stack, x):
  for layer in range(LAYERS):
    x = x + dense_moe_layer(_layer_params(stack, layer), x, K)
  return x


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_scanned_layers_match_dense_and_compile_once(axis_type):
  mesh = _mesh(axis_type)
  group = _group(mesh)
  with jax.set_mesh(mesh):
    model = Stack(group, nnx.Rngs(0))
    # Created under the mesh: the optimizer's step counters then start where the step leaves
    # them (on Explicit axes a counter on one device would be another type after step 1).
    optimizer = nnx.Optimizer(model, optax.adamw(3e-2), wrt=nnx.Param)
  moe = model.blocks.moe
  assert moe.w_gate[...].shape == (LAYERS, E, H, F)
  assert moe.w_gate.out_sharding == (None, "expert", None, None)  # the stacked axis added
  assert tuple(moe.w_gate[...].sharding.spec)[:2] == (None, "expert")
  assert moe.num_dropped.out_sharding == (None, ("data", "expert"))
  stats_sharding = moe.expert_counts[...].sharding

  k_x, k_t = jax.random.split(jax.random.key(1))
  x = jax.random.normal(k_x, (2 * 4 * TOKENS, H), jnp.float32)
  target = jax.random.normal(k_t, x.shape, jnp.float32)

  @nnx.jit
  def step(model, optimizer, x, target):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  with jax.set_mesh(mesh):  # the module's first call: the statistics start as it built them
    losses, compiled = [], []
    for _ in range(4):
      before = len(_lowerings)
      losses.append(float(step(model, optimizer, x, target)))
      compiled.append(len(_lowerings) - before)
  assert compiled[0] >= 1 and compiled[1:] == [0, 0, 0], f"lowerings per step: {compiled}"
  assert losses[-1] < losses[0], losses
  assert moe.expert_counts[...].sharding == stats_sharding
  # Each layer's counts: every token's K slots, over the shards.
  np.testing.assert_array_equal(np.asarray(moe.expert_counts[...]).sum((1, 2)),
                                [x.shape[0] * K] * LAYERS)
  np.testing.assert_array_equal(moe.num_dropped[...], 0)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x),
                             _dense_stack(model, np.asarray(x)), rtol=1e-4, atol=1e-4)


def test_lax_loops_with_and_without_statistics(caplog):
  mesh = _mesh(AxisType.Explicit)
  group = _group(mesh)
  x = jax.random.normal(jax.random.key(2), (2 * 4 * TOKENS, H), jnp.float32)
  quiet = MoE(group, ffn=F, rngs=nnx.Rngs(0), statistics=False)
  assert quiet.num_dropped is None and not nnx.state(quiet, MoEStats)
  loud = MoE(group, ffn=F, rngs=nnx.Rngs(0))
  params = MoEParams(*(None if p is None else np.asarray(p) for p in loud.params))
  want = np.asarray(x)
  for _ in range(3):
    want = want + dense_moe_layer(params, want, K)

  for model in (quiet, loud):
    def body(_, x, model=model):  # closes over the module, as a plain nnx.Linear may be
      return x + model(x)
    with caplog.at_level(logging.INFO, logger="jax_ep"):
      got = jax.jit(lambda x: jax.lax.fori_loop(0, 3, body, x))(x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  # The loop could not write them: the statistics are still the zeros they started as, and
  # the skip was said once, at INFO.
  np.testing.assert_array_equal(loud.expert_counts[...], 0)
  assert any("statistics not recorded" in r.getMessage() for r in caplog.records)

  # nnx.fori_loop passes the module in: the statistics are recorded, the last call's.
  def nnx_body(_, carry):
    model, x = carry
    return model, x + model(x)
  _, got = nnx.jit(lambda m, x: nnx.fori_loop(0, 3, nnx_body, (m, x)))(loud, x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert int(np.asarray(loud.expert_counts[...]).sum()) == x.shape[0] * K


def test_one_module_trains_and_decodes():
  mesh = _mesh(AxisType.Explicit)
  group = _group(mesh)
  decode_group = _group(mesh, max_tokens=1, low_latency=True)
  model = MoE(group, ffn=F, rngs=nnx.Rngs(0), decode_group=decode_group)
  params = MoEParams(*(None if p is None else np.asarray(p) for p in model.params))
  x = jax.random.normal(jax.random.key(3), (2 * 4 * TOKENS, H), jnp.float32)
  one = x[:8]  # a decode step: one token per device

  np.testing.assert_allclose(model(x), dense_moe_layer(params, np.asarray(x), K), rtol=1e-4,
                             atol=1e-5)
  decoded = nnx.jit(lambda m, x: m(x, mode="low_latency"))(model, one)
  np.testing.assert_allclose(decoded, dense_moe_layer(params, np.asarray(one), K), rtol=1e-4,
                             atol=1e-5)
  assert int(np.asarray(model.expert_counts[...]).sum()) == one.shape[0] * K  # decode's call

  # Calls that do not fit get jax_ep's errors, naming the value.
  with pytest.raises(ValueError, match=r"jax_ep.nnx.MoE: x has hidden size 12 \(shape \(64, 12\)\) "
                                       r"but the layer was built for hidden=16"):
    model(x[:, :12])
  with pytest.raises(TypeError, match="jax_ep.nnx.MoE: x must have a floating-point dtype .*"
                                      "got int32"):
    model(x.astype(jnp.int32))
  with pytest.raises(ValueError, match=r"jax_ep.nnx.MoE: x has 16 tokens \(shape \(16, 16\)\), "
                                       r"2 per device over the mesh's 8 devices, more than "
                                       r"max_tokens_per_rank=1 of the decode_group that "
                                       r"mode='low_latency' runs on"):
    model(x[:16], mode="low_latency")
  with pytest.raises(ValueError, match=r"jax_ep.nnx.MoE: x has 12 tokens \(shape \(12, 16\)\), "
                                       r"which do not split evenly over the mesh's 8 devices"):
    model(x[:12])
  with pytest.raises(ValueError, match=r"jax_ep.nnx.MoE: topk_idx must have shape \(64, 2\)"):
    model(x, jnp.zeros((64, 3), jnp.int32), jnp.ones((64, 3)))
  with pytest.raises(TypeError, match="jax_ep.nnx.MoE: topk_idx must have an integer dtype, got "
                                      "float32"):
    model(x, jnp.zeros((64, 2)), jnp.ones((64, 2)))
  with pytest.raises(ValueError, match="jax_ep.nnx.MoE: mode must be None, 'high_throughput' or "
                                       "'low_latency', got 'decode'"):
    model(x, mode="decode")
  with pytest.raises(ValueError, match="jax_ep.nnx.MoE: decode_group has hidden=32 but group "
                                       "has hidden=16"):
    MoE(group, ffn=F, rngs=nnx.Rngs(0), decode_group=jax_ep.Group(
        mesh, "expert", num_experts=E, num_topk=K, hidden=32, max_tokens_per_rank=1,
        backend="reference"))


def test_statistics_off_and_bias_from_given_counts():
  mesh = _mesh(AxisType.Auto)
  group = _group(mesh)
  model = MoE(group, ffn=F, rngs=nnx.Rngs(0), router_bias=True, statistics=False)
  x = jax.random.normal(jax.random.key(4), (2 * 4 * TOKENS, H), jnp.float32)
  result = model(x, return_output=True)
  with pytest.raises(ValueError, match=r"records no statistics \(statistics=False\); pass "
                                       r"expert_counts"):
    model.update_bias(1e-2)
  counts = np.asarray(result.expert_counts).sum(0)
  model.update_bias(1e-2, result.expert_counts)
  np.testing.assert_allclose(model.bias[...], 1e-2 * np.sign(counts.mean() - counts))


def test_strict_group_refuses_every_new_trace():
  mesh = _mesh(AxisType.Explicit)
  group = _group(mesh, capacity=2, strict=True)
  model = MoE(group, ffn=F, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(5), (2 * 4 * TOKENS, H), jnp.float32)
  nnx.jit(lambda m, x: m(x))(model, x).block_until_ready()
  deadline = time.monotonic() + 30  # the drop reaches the host through a callback
  while time.monotonic() < deadline:
    try:
      group.check()
    except jax_ep.CapacityOverflowError:
      break
    time.sleep(0.05)
  else:
    pytest.fail("the strict group's drop never reached the host")
  # Each of these traces the module again (the layer's own compiled program is the same):
  # each raises, not only the first.
  for call in (lambda: model(x), lambda: nnx.jit(lambda m, x: 2 * m(x))(model, x),
               lambda: nnx.jit(lambda m, x: m(x) + 1)(model, x)):
    with pytest.raises(jax_ep.CapacityOverflowError, match="capacity=2"):
      call()


def test_layout_is_metadata_where_eager_sharding_is_off():
  mesh = _mesh(AxisType.Explicit)
  group = _group(mesh)
  with nnx.use_eager_sharding(False):
    model = MoE(group, ffn=F, rngs=nnx.Rngs(0))
  assert len(model.w_gate[...].sharding.device_set) == 1  # placed nowhere but by the caller
  specs = nnx.get_partition_spec(nnx.state(model))
  assert specs["w_gate"].get_value() == P("expert", None, None)
  assert specs["expert_counts"].get_value() == P(("data", "expert"), None)
  x = jax.random.normal(jax.random.key(6), (2 * 4 * TOKENS, H), jnp.float32)
  params = MoEParams(*(None if p is None else np.asarray(p) for p in model.params))
  np.testing.assert_allclose(model(x), dense_moe_layer(params, np.asarray(x), K), rtol=1e-4,
                             atol=1e-5)
