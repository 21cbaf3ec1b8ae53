"""The whole MoE layer: `jax_ep.moe_mlp` and the NNX module against the dense reference, and the
`python -m jax_ep.demo` main-job smoke test.

The dense model (`jax_ep.testing.dense`) computes every expert on every token with no sharding and
no communication; the expert-parallel layer must agree with it in value and in gradient (w.r.t.
the activations, the router and every expert weight).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from ep_test_base import rank_mesh
from jax_ep import launch
from jax_ep.layer import MoEParams
from jax_ep.testing.dense import dense_moe, dense_moe_layer

REPO = pathlib.Path(__file__).resolve().parents[1]


def make_group(num_ranks, *, num_experts, num_topk, hidden, max_tokens, dtype, **options):
  if jax.process_count() > 1 and num_ranks > jax.local_device_count():
    # The tests here feed whole host arrays and compare whole outputs and gradients with the
    # dense model; with one process per device a process cannot read the others' shards. The
    # ops under these layers run multi-process in test_reference's suite.
    pytest.skip("compares whole global arrays; single-process (or R=1 per process) only")
  mesh = rank_mesh(num_ranks)
  return jax_ep.Group(mesh, "ep", num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                      max_tokens_per_rank=max_tokens, dtype=dtype, backend="reference",
                      **options)


def assert_close_to_scale(got, want, rel, what):
  """max |got - want| <= rel * max |want| (errors relative to the array's scale)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  scale = np.abs(want).max()
  assert scale > 0, f"{what}: reference is all zero (test would be vacuous)"
  err = np.abs(got - want).max()
  assert err <= rel * scale, f"{what}: max abs err {err:.3e} > {rel:g} * scale {scale:.3e}"


def _inputs(num_ranks, num_experts, hidden, ffn, tokens, dtype, seed=0):
  k_p, k_x, k_c = jax.random.split(jax.random.key(seed), 3)
  params = jax_ep.init_moe_params(k_p, num_experts=num_experts, hidden=hidden, ffn=ffn,
                                  dtype=dtype)
  x = jax.random.normal(k_x, (num_ranks * tokens, hidden), jnp.float32).astype(dtype)
  cot = jax.random.normal(k_c, (num_ranks * tokens, hidden), jnp.float32)
  return params, x, cot


# ---------------------------------------------------------------------- moe_mlp vs dense
@pytest.mark.parametrize("mode", ["high_throughput", "low_latency"])
@pytest.mark.parametrize("num_ranks,dtype,rel", [
    (1, jnp.float32, 1e-4), (4, jnp.float32, 1e-4), (8, jnp.float32, 1e-4),
    (4, jnp.bfloat16, 3e-2)])
def test_moe_mlp_matches_dense(num_ranks, dtype, rel, mode):
  """Both modes of the layer (the low-latency one runs the experts on the decode slabs)
  against the dense model: values and gradients."""
  num_experts, num_topk, hidden, ffn, tokens = 16, 4, 64, 32, 8
  group = make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                     max_tokens=tokens, dtype=dtype)
  params, x, cot = _inputs(num_ranks, num_experts, hidden, ffn, tokens, dtype)

  def loss(params, x):
    out, num_dropped = jax_ep.moe_mlp(group, params, x, mode=mode)[:2]
    return jnp.sum(out.astype(jnp.float32) * cot), (out, num_dropped)

  def dense_loss(params, x):
    out = dense_moe_layer(params, x, num_topk)
    return jnp.sum(out.astype(jnp.float32) * cot), out

  (_, (out, dropped)), grads = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  (_, want), dense_grads = jax.jit(
      jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True))(params, x)

  assert out.dtype == dtype and dropped.shape == (num_ranks,)
  np.testing.assert_array_equal(dropped, 0)
  assert_close_to_scale(out, want, rel, "forward")
  (g_params, g_x), (d_params, d_x) = grads, dense_grads
  assert_close_to_scale(g_x, d_x, rel, "grad x")
  for name, g, d in zip(MoEParams._fields, g_params, d_params):
    if g is None:  # a field this layer has not (no bias, no shared expert)
      assert d is None, name
      continue
    assert g.dtype == d.dtype, f"grad {name}: dtype {g.dtype} != {d.dtype}"
    assert_close_to_scale(g, d, rel, f"grad {name}")


@pytest.mark.parametrize("num_ranks", [1, 4])
def test_moe_mlp_with_expert_alignment_matches_dense(num_ranks):
  """The layer on a group with expert_alignment: the experts' GEMMs take the dispatch's
  group_offsets (padding between the experts' rows), values and gradients as the dense
  model's."""
  num_experts, num_topk, hidden, ffn, tokens = 16, 4, 64, 32, 8
  group = make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                     max_tokens=tokens, dtype=jnp.float32, expert_alignment=16)
  params, x, cot = _inputs(num_ranks, num_experts, hidden, ffn, tokens, jnp.float32, seed=3)

  def loss(params, x):
    out = jax_ep.moe_mlp(group, params, x).out
    return jnp.sum(out * cot), out

  def dense_loss(params, x):
    out = dense_moe_layer(params, x, num_topk)
    return jnp.sum(out * cot), out

  (_, out), (g_params, g_x) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  (_, want), (d_params, d_x) = jax.jit(
      jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True))(params, x)
  assert_close_to_scale(out, want, 1e-4, "forward")
  assert_close_to_scale(g_x, d_x, 1e-4, "grad x")
  for name, g, d in zip(MoEParams._fields, g_params, d_params):
    if g is not None:
      assert_close_to_scale(g, d, 1e-4, f"grad {name}")


def test_moe_mlp_given_routing_with_masked_slots():
  """Explicit routing with -1 and out-of-range slots (both select nothing): values and gradients
  w.r.t. x, the router weights and the experts."""
  num_ranks, num_experts, num_topk, hidden, ffn, tokens = 4, 8, 3, 64, 32, 8
  group = make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                     max_tokens=tokens, dtype=jnp.float32)
  params, x, cot = _inputs(num_ranks, num_experts, hidden, ffn, tokens, jnp.float32, seed=1)
  rng = np.random.default_rng(0)
  n = num_ranks * tokens
  idx = np.stack([rng.permutation(num_experts)[:num_topk] for _ in range(n)]).astype(np.int32)
  idx[rng.random(idx.shape) < 0.25] = -1
  idx[rng.random(idx.shape) < 0.1] = num_experts + 1
  w = rng.random((n, num_topk)).astype(np.float32)

  def loss(params, x, w):
    out = jax_ep.moe_mlp(group, params, x, idx, w).out
    return jnp.sum(out * cot)

  def dense_loss(params, x, w):
    return jnp.sum(dense_moe(params, x, idx, w) * cot)

  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, x, w)
  want = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2)))(params, x, w)
  assert_close_to_scale(got[0], want[0], 1e-4, "loss")
  (g_params, g_x, g_w), (d_params, d_x, d_w) = got[1], want[1]
  assert_close_to_scale(g_x, d_x, 1e-4, "grad x")
  assert_close_to_scale(g_w, d_w, 1e-4, "grad topk_weights")
  np.testing.assert_array_equal(np.asarray(g_w)[(idx < 0) | (idx >= num_experts)], 0)
  for name in ("w_gate", "w_up", "w_down"):
    assert_close_to_scale(getattr(g_params, name), getattr(d_params, name), 1e-4, f"grad {name}")


# ---------------------------------------------------------------------- NNX module
def test_nnx_module_forward_and_training_step():
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE, MoEStats

  num_ranks, num_experts, num_topk, hidden, ffn, tokens = 4, 8, 2, 64, 32, 16
  group = make_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                     max_tokens=tokens, dtype=jnp.float32)
  model = MoE(group, ffn=ffn, rngs=nnx.Rngs(0))
  assert model.w_gate[...].shape == (num_experts, hidden, ffn)
  assert model.w_down[...].shape == (num_experts, ffn, hidden)
  assert model.router[...].shape == (hidden, num_experts)
  assert model.w_gate[...].sharding.spec[0] == "ep"  # experts split over the EP axis
  assert isinstance(model.num_dropped, MoEStats)

  k_x, k_t = jax.random.split(jax.random.key(1))
  x = jax.random.normal(k_x, (num_ranks * tokens, hidden), jnp.float32)
  target = jax.random.normal(k_t, (num_ranks * tokens, hidden), jnp.float32)

  out = model(x)
  dense_params = jax.tree.map(np.asarray, model.params)
  assert_close_to_scale(out, dense_moe_layer(MoEParams(*dense_params), np.asarray(x), num_topk),
                        1e-4, "nnx forward")
  np.testing.assert_array_equal(model.num_dropped[...], np.zeros(num_ranks, np.int32))

  def loss_fn(model, x, target):
    return jnp.mean((model(x) - target) ** 2)

  @nnx.jit
  def train_step(model, x, target):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, target)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 1.0 * g, params, grads))
    return loss

  loss0 = float(train_step(model, x, target))
  loss1 = float(loss_fn(model, x, target))
  assert np.isfinite(loss0) and loss1 < loss0, f"loss did not go down: {loss0} -> {loss1}"
  assert model.w_gate[...].sharding.spec[0] == "ep"  # the update kept the layout


# ---------------------------------------------------------------------- main job
def test_main_job_demo_smoke():
  """MAIN-JOB SMOKE TEST: `python -m jax_ep.demo --steps 3` trains, matches dense, prints table."""
  env = dict(os.environ)
  barrier = None
  if jax.process_count() > 1:
    # Under jax_ep.launch: the demo is its own single-process job, run once (by process 0), on
    # the memory the test processes left (each preallocated most of its GPU). The others wait
    # for it, so that a later test's group creation does not time out waiting for process 0.
    from jax._src import distributed
    client = distributed.global_state.client
    barrier = lambda: client.wait_at_barrier("jax_ep/tests/demo_smoke", 240_000)  # noqa: E731
    if jax.process_index() != 0:
      barrier()
      pytest.skip("the demo runs once per job, in process 0")
    for name in launch.CHILD_ENV_VARS:
      env.pop(name, None)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  try:
    proc = subprocess.run([sys.executable, "-m", "jax_ep.demo", "--steps", "3"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
  finally:
    if barrier is not None:
      barrier()
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, f"demo exited {proc.returncode}:\n{output}"
  for needle in ("backend", "devices", "R / E / K / H / F / T", "median step time",
                 "loss first -> last", "max grad rel err", "PASSED"):
    assert needle in proc.stdout, f"{needle!r} missing from the demo's table:\n{output}"
  assert "compiled" not in proc.stderr, f"train_step recompiled after step 0:\n{output}"
  if all(d.platform == "cpu" for d in jax.devices()):
    assert "8 x cpu" in proc.stdout, proc.stdout
