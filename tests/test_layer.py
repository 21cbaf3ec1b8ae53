"""The whole MoE layer: `jax_ep.moe_mlp` and the NNX module against the dense reference, on every
backend, and the `python -m jax_ep.demo` main-job smoke test.

The dense model (`jax_ep.testing.dense`) computes every expert on every token with no sharding and
no communication; the expert-parallel layer must agree with it in value and in gradient (w.r.t.
the activations, the router and every expert weight). The tests that take a `backend` run on the
reference backend and on the cuda backend (marked `gpu`: skipped on the CPU, a failure under
JAX_EP_REQUIRE_GPU=1 where there is no GPU). `TestModelShapes` (GPU only) trains the layer at
the expert shapes of real models; on Hopper the experts run jax_ep's Mosaic GPU grouped GEMM
inside `shard_map`, the path whose backward the CPU cannot run. On a GPU:

  python -m pytest tests/test_layer.py -m gpu -q                                   # R = 1
  python -m jax_ep.launch -n 4 --share-gpu -- python -m pytest tests/test_layer.py -m gpu -q

Under the launcher every process builds the same host arrays, runs the layer on the whole mesh,
computes the dense model on its own device, and compares the shards it holds: its tokens'
outputs and input gradients, its experts' weight gradients (`TestModelShapes`); the tests that
compare whole global arrays run their one-rank groups only. Processes sharing one GPU
(`--share-gpu`) cannot run XLA collectives, and `moe_mlp`'s gradient of the replicated router
is one (the sum of the shards' parts): there the layer trains through `moe_mlp_per_shard`
inside `shard_map`, each shard on its own copy of the router, and the router's gradient of
each shard's tokens is compared with the dense model's for the same tokens.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
from ep_test_base import (REFERENCE, Target, grouped_matmul_kernels, make_target_group,
                          rank_mesh, require_gpu)
from jax_ep import launch
from jax_ep.layer import MoEOutput, MoEParams
from jax_ep.testing.dense import dense_moe, dense_moe_layer

REPO = pathlib.Path(__file__).resolve().parents[1]

# The cuda backend at whatever rank counts the job's GPUs make (one rank each).
CUDA = Target("cuda backend", "cuda")


def make_group(num_ranks, *, num_experts, num_topk, hidden, max_tokens, dtype, target=REFERENCE,
               **options):
  """A group of `target` (by default the reference backend) for the layer tests here and in
  the test_layer_*.py and test_routing.py files."""
  if jax.process_count() > 1 and num_ranks > jax.local_device_count():
    # The tests here feed whole host arrays and compare whole outputs and gradients with the
    # dense model; with one process per device a process cannot read the others' shards. The
    # ops under these layers run multi-process in test_reference's suite.
    pytest.skip("compares whole global arrays; single-process (or R=1 per process) only")
  return make_target_group(target, num_ranks, num_experts=num_experts, num_topk=num_topk,
                           hidden=hidden, max_tokens=max_tokens, dtype=dtype, **options)


@pytest.fixture(params=[pytest.param(REFERENCE, id="reference"),
                        pytest.param(CUDA, id="cuda", marks=pytest.mark.gpu)])
def new_group(request):
  """`new_group(num_ranks, **make_group's arguments)`: a group of the test's backend, closed
  when the test ends (a run-time failure no op has raised yet fails its teardown)."""
  groups = []

  def make(num_ranks, **kwargs):
    groups.append(make_group(num_ranks, target=request.param, **kwargs))
    return groups[-1]
  yield make
  errors = []
  for group in reversed(groups):
    try:
      group.close()
    except Exception as error:  # noqa: BLE001 - close the others, then raise the first
      errors.append(error)
  if errors:
    raise errors[0]


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
def test_moe_mlp_matches_dense(new_group, num_ranks, dtype, rel, mode):
  """Both modes of the layer (the low-latency one runs the experts on the decode slabs; its
  group has the low-latency buffers, as the cuda backend needs) against the dense model:
  values and gradients."""
  num_experts, num_topk, hidden, ffn, tokens = 16, 4, 64, 32, 8
  group = new_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                    max_tokens=tokens, dtype=dtype, low_latency=mode == "low_latency")
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
def test_moe_mlp_with_expert_alignment_matches_dense(new_group, num_ranks):
  """The layer on a group with expert_alignment: the experts' GEMMs take the dispatch's
  group_offsets (padding between the experts' rows), values and gradients as the dense
  model's."""
  num_experts, num_topk, hidden, ffn, tokens = 16, 4, 64, 32, 8
  group = new_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
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


def test_moe_mlp_given_routing_with_masked_slots(new_group):
  """Explicit routing with -1 and out-of-range slots (both select nothing): values and gradients
  w.r.t. x, the router weights and the experts."""
  num_ranks, num_experts, num_topk, hidden, ffn, tokens = 4, 8, 3, 64, 32, 8
  group = new_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
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
def test_nnx_module_forward_and_training_step(new_group):
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE, MoEStats

  num_ranks, num_experts, num_topk, hidden, ffn, tokens = 4, 8, 2, 64, 32, 16
  group = new_group(num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
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


# ---------------------------------------------------------------------- model shapes (GPU)
# name: (experts, hidden, ffn, top-k). At R > 1 every process holds all of DeepSeek-V3's
# experts (the dense twin's weights and their gradients beside its layer's): its ffn is cut to
# 1024 / R, so that R processes sharing one GPU hold what one holds at ffn 1024 (R=4: 256).
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
    f = 1024 // num_ranks
  return e, h, f, k


def _mesh():
  require_gpu()
  num_ranks = jax.device_count()
  return rank_mesh(num_ranks), num_ranks


def _model_inputs(num_experts, hidden, ffn, tokens, seed=0, param_dtype=jnp.bfloat16, key=None):
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


# Relative error bounds (`|got - want| / |want|`, per token row or per expert) against the
# dense model given the layer's own routing, both computing in bf16 with fp32 accumulation:
# they differ by the order of the fp32 sums (now and then one bf16 step of an element) and, in
# the backward, where the cotangent is rounded to bf16. The output's bound fails a 1 % change
# of the output (each check shows it: `mutation`); the gradients' allow the layer's bf16
# cotangents (measured ~0.5 % per row beside the dense model's float32 ones).
OUT_BOUND = 5e-3
GRAD_BOUND = 1.5e-2


def _relative_errors(got, want, per_slice, scale=1.0):
  """`(errors, norms)`: per leading index of each shard of `got` this process holds (or of the
  whole shard with `per_slice=False`), `|scale * got - want|` and `|want|` over that block of
  the dense `want`. Computed on the device a slice at a time (float32 copies of DeepSeek-V3's
  whole weight gradients do not fit beside the layer's)."""
  f32 = jnp.float32
  axes = lambda a: tuple(range(1, a.ndim)) if per_slice else tuple(range(a.ndim))
  errors, norms = [], []
  for shard in got.addressable_shards:
    ref_all = jax.device_put(want[shard.index], shard.data.device)
    err2 = norm2 = 0.0
    for c in _chunks(shard.data):
      block, ref = shard.data[c].astype(f32) * scale, ref_all[c].astype(f32)
      assert bool(jnp.isfinite(block).all()), "not finite"
      e2, n2 = jnp.sum((block - ref) ** 2, axes(block)), jnp.sum(ref ** 2, axes(ref))
      if per_slice:
        errors.append(np.sqrt(np.asarray(e2, np.float64)))
        norms.append(np.sqrt(np.asarray(n2, np.float64)))
      else:
        err2, norm2 = err2 + float(e2), norm2 + float(n2)
    if not per_slice:
      errors.append(np.sqrt([err2]))
      norms.append(np.sqrt([norm2]))
  return np.concatenate(errors), np.concatenate(norms)


def _assert_close(got, want, bound, what, per_slice=True, mutation=False):
  """The relative error of each token row / expert (`per_slice`) or of each shard within
  `bound`; a slice whose reference is zero must be zero. With `mutation`, also that the same
  check fails for `got * 1.01` (the bound is tight enough to see a 1 % change)."""
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  try:
    errors, norms = _relative_errors(got, want, per_slice)
  except AssertionError as e:
    raise AssertionError(f"{what}: {e}") from None
  assert norms.max() > 0, f"{what}: the dense reference is all zero"
  ratio = errors / np.maximum(norms, 1e-30)
  worst = int(np.argmax(ratio))
  assert (errors <= bound * norms).all(), (
      f"{what}: relative error {ratio[worst]:.3e} at slice {worst} > {bound:g} "
      f"({int((errors > bound * norms).sum())} of {len(errors)} slices; median "
      f"{np.median(ratio):.3e})")
  if mutation:
    m_errors, m_norms = _relative_errors(got, want, per_slice, scale=1.01)
    assert not (m_errors <= bound * m_norms).all(), (
        f"{what}: the bound {bound:g} does not see the output scaled by 1.01")


def _dense(params, x, cot, topk_idx, router_parts=None):
  """The dense model on this process's device, computing in bf16 like the layer, given the
  experts the layer's router chose (`topk_idx`, all tokens): its weights are the dense
  router's softmax scores at them, renormalised (the layer's `Routing()`), so the router's
  value and gradient are checked, and a token whose top-k differs by a rounding of its logits
  (a near-tie) compares like the others. Returns the output and the gradients (params, x);
  with `router_parts=R` the router's gradient is `[R, H, E]`, that of each of R equal runs
  of the tokens (the shards' parts, which `_training_step` leaves unsummed)."""
  topk_idx = jnp.asarray(topk_idx)
  f32 = jnp.float32

  def loss(params, x, logits_shift):
    logits = x.astype(f32) @ params.router.astype(f32) + logits_shift
    weights = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), topk_idx, axis=-1)
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)
    out = dense_moe(params, x, topk_idx, weights, dtype=jnp.bfloat16)
    return jnp.sum(out.astype(f32) * cot), out
  # The zero shift's gradient is each token's d loss / d logits, from which the router's
  # gradient of any run of tokens follows.
  shift = jnp.zeros((x.shape[0], params.router.shape[1]), f32)
  (_, out), (d_params, d_x, d_logits) = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(params, x, shift)
  if router_parts:
    parts = jnp.einsum("rth,rte->rhe", x.astype(f32).reshape(router_parts, -1, x.shape[1]),
                       d_logits.reshape(router_parts, -1, d_logits.shape[1]),
                       precision=jax.lax.Precision.HIGHEST)
    d_params = d_params._replace(router=parts.astype(d_params.router.dtype))
  return out, (d_params, d_x)


_GATHERS = itertools.count()


def _gathered(array):
  """A small global array (the routing) whole on the host, its shards from every process
  through the job's key-value store (processes sharing one GPU cannot run XLA collectives)."""
  if array.is_fully_addressable:
    return np.asarray(array)
  from jax_ep.launch import _distributed
  mine = [(shard.index[0].start or 0, np.asarray(shard.data).tolist())
          for shard in array.addressable_shards]
  values = _distributed.gather_values(f"test_layer/{next(_GATHERS)}", json.dumps(mine),
                                      process_ids=range(jax.process_count()))
  whole = np.zeros(array.shape, array.dtype)
  for value in values:
    for start, rows in json.loads(value):
      whole[start:start + len(rows)] = np.asarray(rows, array.dtype)
  return whole


def _assert_grouped_gemm_kernels(fn, args, calls):
  """The experts' products ran jax_ep's Mosaic GPU grouped GEMM: `calls` kernel calls and no
  `lax.ragged_dot` in the traced program (its fallback)."""
  mosaic, ragged = grouped_matmul_kernels(fn, *args)
  assert (mosaic, ragged) == (calls, 0), (
      f"expected {calls} Mosaic GPU grouped GEMM calls and no lax.ragged_dot, traced {mosaic} "
      f"kernel calls and {ragged} ragged_dot products")


def _check_layer(result, d_params, d_x, want, what=""):
  """The layer's output, input gradient and every parameter's gradient against the dense
  model's (`want`: output, (params, x) gradients): per token row, per expert, per shard."""
  want_out, (want_params, want_x) = want
  if result is not None:
    assert not any(int(s.data.sum()) for s in result.num_dropped.addressable_shards)
    _assert_close(result.out, want_out, OUT_BOUND, f"{what}out", mutation=True)
  _assert_close(d_x, want_x, GRAD_BOUND, f"{what}grad x")
  for field in ("router", "w_gate", "w_up", "w_down"):
    got = getattr(d_params, field)
    if got is None:
      continue
    want_field = getattr(want_params, field)
    assert got.dtype == want_field.dtype, f"grad {field}: {got.dtype} != {want_field.dtype}"
    # The router's gradient as a whole (per shard); the experts' one expert at a time.
    _assert_close(got, want_field, GRAD_BOUND, f"{what}grad {field}",
                  per_slice=field != "router")


def _nnx_grads(model, x, cot):
  """The gradients of `sum(model(x) * cot)` with respect to the module and `x`, in one compiled
  step, and the experts the module's router chose (`topk_idx`)."""
  nnx = pytest.importorskip("flax.nnx")

  @nnx.jit
  def step(model, x, cot):
    def loss(model, x):
      result = model(x, return_output=True)
      return jnp.sum(result.out.astype(jnp.float32) * cot), result.topk_idx
    return nnx.grad(loss, argnums=(0, 1), has_aux=True)(model, x)
  (d_model, d_x), topk_idx = step(model, x, cot)
  return d_model, d_x, topk_idx


def _shared_gpu():
  """Processes of one job sharing one GPU (`jax_ep.launch --share-gpu`): they cannot run XLA
  collectives (NCCL refuses a second process on the same device)."""
  return os.environ.get(launch.ENV_SHARED_GPU) == "1" and jax.process_count() > 1


# The statistics `moe_mlp` returns with a leading axis of the shards (`MoEOutput`).
_PER_SHARD_FIELDS = ("num_dropped", "aux_loss", "z_loss", "expert_counts", "num_invalid")


def _training_step(group, mesh, params, x, cot, **options):
  """`(step, args)`: the jitted gradient of `sum(out * cot)` with respect to the parameters and
  `x` for the layer on `group` (`options` for `moe_mlp`), and its global arguments from
  `params`, `x` and `cot` (the same on every process). `step(*args)` returns `((loss,
  MoEOutput), (d_params, d_x))`, the statistics one per shard.

  `jax_ep.moe_mlp` on global arrays, as a training step calls it; on a shared GPU (no XLA
  collectives, so no sum over the shards) `moe_mlp_per_shard` inside `shard_map`, each shard
  on its own copy of every replicated parameter (given `[R, ...]`, split over "ep"): their
  gradients come back `[R, ...]`, each shard's part (`_dense`'s `router_parts`)."""
  specs = jax_ep.layer.param_specs("ep", params)
  g_x, g_cot = _global(mesh, x, P("ep")), _global(mesh, cot, P("ep"))
  if not _shared_gpu():
    g_params = MoEParams(*(None if p is None else _global(mesh, p, s)
                           for p, s in zip(params, specs)))

    def loss(params, x, cot):
      result = jax_ep.moe_mlp(group, params, x, **options)
      return jnp.sum(result.out.astype(jnp.float32) * cot), result
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)), (g_params, g_x, g_cot)

  num_ranks = mesh.size
  copied = MoEParams(*(p is not None and s == P() for p, s in zip(params, specs)))
  g_params = MoEParams(*(
      None if p is None else
      _global(mesh, jnp.broadcast_to(p[None], (num_ranks, *p.shape)) if c else p, P("ep"))
      for p, c in zip(params, copied)))
  split = MoEParams(*(None if p is None else P("ep") for p in params))

  def body(params, x, cot):
    params = MoEParams(*(p[0] if c else p for p, c in zip(params, copied)))

    def loss(params, x):
      result = jax_ep.moe_mlp_per_shard(group, params, x, **options)
      return jnp.sum(result.out.astype(jnp.float32) * cot), result
    (value, result), (d_params, d_x) = jax.value_and_grad(loss, argnums=(0, 1),
                                                          has_aux=True)(params, x)
    d_params = MoEParams(*(g[None] if c else g for g, c in zip(d_params, copied)))
    result = result._replace(**{f: getattr(result, f)[None] for f in _PER_SHARD_FIELDS})
    return (value[None], result), (d_params, d_x)
  out_specs = ((P("ep"), MoEOutput(*(P("ep"),) * len(MoEOutput._fields))), (split, P("ep")))
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(split, P("ep"), P("ep")),
                               out_specs=out_specs))
  return step, (g_params, g_x, g_cot)


def _skip_on_a_shared_gpu(what):
  if _shared_gpu():
    pytest.skip(f"{what} sums the replicated router's gradient over the shards, an XLA "
                "all-reduce, which processes sharing one GPU cannot run (the layer's model-shape "
                "tests train each shard's part there)")


def test_training_step_on_a_shared_gpu_gives_each_shards_part(monkeypatch):
  """`_training_step`'s shared-GPU form (`moe_mlp_per_shard` in `shard_map`, each shard's copy
  of the router) against its `moe_mlp` form on the reference backend at R=4: the same output
  and gradients, the router's as four parts that sum to the whole; and `_dense`'s
  `router_parts`, which the GPU tests compare those parts with, sum to its whole gradient."""
  num_ranks, e, h, f, k = 4, 16, 64, 32, 4
  group = make_group(num_ranks, num_experts=e, num_topk=k, hidden=h, max_tokens=8,
                     dtype=jnp.float32)
  params, x, cot = _inputs(num_ranks, e, h, f, 8, jnp.float32)
  runs = {}
  for shared in (False, True):
    monkeypatch.setattr(sys.modules[__name__], "_shared_gpu", lambda shared=shared: shared)
    step, args = _training_step(group, group.mesh, params, x, cot)
    runs[shared] = step(*args)
  (_, want), (want_params, want_x) = runs[False]
  (_, got), (got_params, got_x) = runs[True]
  assert_close_to_scale(got.out, want.out, 1e-5, "out")
  assert_close_to_scale(got_x, want_x, 1e-5, "grad x")
  np.testing.assert_array_equal(got.num_dropped, want.num_dropped)
  for field in ("w_gate", "w_up", "w_down"):
    assert_close_to_scale(getattr(got_params, field), getattr(want_params, field), 1e-5, field)
  assert got_params.router.shape == (num_ranks, *params.router.shape)
  assert_close_to_scale(got_params.router.sum(0), want_params.router, 1e-5, "router parts")
  topk_idx = np.asarray(want.topk_idx)
  _, (whole, _) = _dense(params, x, cot, topk_idx)
  _, (parts, _) = _dense(params, x, cot, topk_idx, router_parts=num_ranks)
  assert parts.router.shape == (num_ranks, *params.router.shape)
  assert_close_to_scale(parts.router.sum(0), whole.router, 1e-5, "dense router parts")


@pytest.mark.gpu
class TestModelShapes:
  """The layer and the NNX module train at the expert shapes of real models against the dense
  model on the cuda backend (GPU only: the CPU has no counterpart of these sizes)."""

  @pytest.mark.parametrize("name", list(SHAPES))
  def test_moe_mlp_trains_at_model_shapes(self, name):
    self._train_at_model_shape(name)

  @pytest.mark.parametrize("name", ["qwen3_30b_a3b", "e32"])
  @pytest.mark.parametrize("expert_alignment", [64, 128])
  def test_moe_mlp_trains_with_expert_alignment(self, name, expert_alignment):
    """As above on a group whose experts' rows start at multiples of a row tile: the grouped
    GEMM's kernels take the dispatch's group_offsets (padding between the experts' rows)."""
    self._train_at_model_shape(name, expert_alignment)

  @staticmethod
  def _train_at_model_shape(name, expert_alignment=1):
    mesh, num_ranks = _mesh()
    e, h, f, k = _shape(name, num_ranks)
    params, x, cot = _model_inputs(e, h, f, num_ranks * TOKENS)
    with jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h,
                      max_tokens_per_rank=TOKENS, dtype=jnp.bfloat16,
                      expert_alignment=expert_alignment) as group:
      assert group.backend_name == "cuda", group.backend_reason
      step, args = _training_step(group, mesh, params, x, cot)
      # The fused experts (the default on Hopper): gate-up and down forward; the activation's
      # derivative fused into dy @ w_down^T; both projections' input gradient in one kernel;
      # three weight gradients.
      _assert_grouped_gemm_kernels(step, args, 7)
      (_, result), (d_params, d_x) = step(*args)
      jax.block_until_ready(d_x)
      group.check()
    del args
    want = _dense(params, x, cot, _gathered(result.topk_idx),
                  router_parts=num_ranks if _shared_gpu() else None)
    del params
    _check_layer(result, d_params, d_x, want)

  @pytest.mark.parametrize("name", list(SHAPES))
  def test_nnx_module_trains_at_model_shapes(self, name):
    """The NNX module's training step, its weights stored in float32 and computed in bf16 (the
    group's dtype), as Flax layers do; DeepSeek-V3's stored in bf16 (float32 weights, their
    gradients and the dense twin's would not fit one GPU)."""
    nnx = pytest.importorskip("flax.nnx")
    from jax_ep.nnx import MoE
    mesh, num_ranks = _mesh()
    _skip_on_a_shared_gpu("the module's training step")
    e, h, f, k = _shape(name, num_ranks)
    param_dtype = jnp.bfloat16 if name == "deepseek_v3" else jnp.float32
    # The module draws its weights from rngs.params() exactly so; every process draws the same.
    def draw():
      return _model_inputs(e, h, f, num_ranks * TOKENS, seed=1, param_dtype=param_dtype,
                           key=nnx.Rngs(0).params())
    params, x, cot = draw()
    with jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h,
                      max_tokens_per_rank=TOKENS, dtype=jnp.bfloat16) as group:
      model = MoE(group, ffn=f, rngs=nnx.Rngs(0), param_dtype=param_dtype)
      for field, want_field in zip(MoEParams._fields, params):
        if want_field is not None:
          _assert_close(getattr(model.params, field), want_field, 0.0, f"the module's {field}")
      # Drawn again for the dense model once the module is gone: beside the step's weights and
      # gradients, a third copy of DeepSeek-V3's experts (21 GiB in bf16) does not fit an H100.
      del params
      g_x, g_cot = _global(mesh, x, P("ep")), _global(mesh, cot, P("ep"))
      d_model, d_x, topk_idx = _nnx_grads(model, g_x, g_cot)
      jax.block_until_ready(d_x)
      group.check()
    del model
    params, _, _ = draw()
    want = _dense(params, x, cot, _gathered(topk_idx))
    del params
    d_params = MoEParams(*[None] * len(MoEParams._fields))._replace(
        w_gate=d_model.w_gate[...], w_down=d_model.w_down[...])
    for field in ("w_gate", "w_down"):
      assert getattr(d_params, field).dtype == param_dtype, f"grad {field}"
    _check_layer(None, d_params, d_x, want, "nnx: ")

  def test_nnx_module_trains_and_decodes_on_one_set_of_weights(self):
    """One `jax_ep.nnx.MoE` for training and decode: a training step (dispatch, the grouped GEMM,
    combine) and a decode call (`mode="low_latency"` on its decode group: the low-latency kernels
    and the slab experts) on the same weights, each against the dense model."""
    nnx = pytest.importorskip("flax.nnx")
    from jax_ep.nnx import MoE
    mesh, num_ranks = _mesh()
    _skip_on_a_shared_gpu("the module's training step")
    e, h, f, k = SHAPES["e32"]
    decode_tokens = 8  # per rank
    params, x, cot = _model_inputs(e, h, f, num_ranks * TOKENS, seed=3, param_dtype=jnp.float32,
                             key=nnx.Rngs(0).params())
    x_decode = x[:num_ranks * decode_tokens]
    options = dict(num_experts=e, num_topk=k, hidden=h, dtype=jnp.bfloat16)
    with jax_ep.Group(mesh, "ep", max_tokens_per_rank=TOKENS, **options) as group, \
         jax_ep.Group(mesh, "ep", max_tokens_per_rank=decode_tokens, low_latency=True,
                      **options) as decode_group:
      assert decode_group.backend_name == "cuda", decode_group.backend_reason
      model = MoE(group, ffn=f, rngs=nnx.Rngs(0), decode_group=decode_group)
      g_x, g_cot = _global(mesh, x, P("ep")), _global(mesh, cot, P("ep"))
      d_model, d_x, topk_idx = _nnx_grads(model, g_x, g_cot)
      decoded = nnx.jit(lambda m, x: m(x, mode="low_latency", return_output=True))(
          model, _global(mesh, x_decode, P("ep")))
      jax.block_until_ready((d_x, decoded.out))
      group.check()
      decode_group.check()
    want = _dense(params, x, cot, _gathered(topk_idx))
    want_decode, _ = _dense(params, x_decode, jnp.zeros(x_decode.shape, jnp.float32),
                            _gathered(decoded.topk_idx))
    del params
    d_params = MoEParams(*[None] * len(MoEParams._fields))._replace(w_gate=d_model.w_gate[...])
    _check_layer(None, d_params, d_x, want, "train: ")
    _assert_close(decoded.out, want_decode, OUT_BOUND, "decoded out", mutation=True)

  def test_moe_mlp_low_latency_trains_at_a_model_shape(self):
    """The decode layer (`mode="low_latency"`: the low-latency pair, the experts on its slabs
    through the Pallas slab kernels) forward and backward inside shard_map."""
    mesh, num_ranks = _mesh()
    e, h, f, k = SHAPES["e32"]
    tokens = 128
    params, x, cot = _model_inputs(e, h, f, num_ranks * tokens, seed=2)
    with jax_ep.Group(mesh, "ep", num_experts=e, num_topk=k, hidden=h,
                      max_tokens_per_rank=tokens, dtype=jnp.bfloat16, low_latency=True) as group:
      step, args = _training_step(group, mesh, params, x, cot, mode="low_latency")
      (_, result), (d_params, d_x) = step(*args)
      jax.block_until_ready(d_x)
      group.check()
    want = _dense(params, x, cot, _gathered(result.topk_idx),
                  router_parts=num_ranks if _shared_gpu() else None)
    _check_layer(result, d_params, d_x, want, "low latency: ")


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
