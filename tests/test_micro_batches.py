"""`micro_batches` in the MoE layer (`jax_ep.moe_mlp`, `moe_mlp_per_shard`, `jax_ep.nnx.MoE`): the
split layer against the unsplit one, on every backend (the cuda cases are marked `gpu`).

The oracle is the same layer with `micro_batches=1`. The routing, the losses and the statistics
are computed once on a shard's whole tokens, so they are the unsplit layer's exactly. On the
reference backend in float32 the output and `num_dropped` are exact too (each token's rows meet
the same weights and are combined in the same order); the gradients of the weights (and of the
router, through the weights of the slots) add the micro-batches' partial sums in another order,
so they agree within float32 rounding; in bfloat16 everything that is not exact agrees within
bfloat16 rounding. The structure of the program is checked as well: `micro_batches=1` traces
the unsplit program, `n` micro-batches trace `n` dispatches and combines, and the longest chain
of communication ops, forward and backward, is as long as the unsplit layer's (no micro-batch
waits for another's results, so XLA may overlap them). The tests that take `comm_stream` run
twice: as XLA schedules the micro-batches, and interleaved by jax_ep's own pipeline
(`Group(comm_stream="jax_ep")`, jax_ep/overlap.py), which the reference backend runs too.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_test_base import count_primitive, make_routing, rank_devices
from jax_ep.layer import MoEParams, param_specs
from test_layer import assert_close_to_scale, make_group, new_group  # noqa: F401 - a fixture
from test_capacity import _residual_bytes
from test_layer_activations import _residual_shapes

F32 = jnp.float32
E, K, H, F, FS = 16, 4, 32, 16, 8  # experts, top-k, hidden, ffn, the shared expert's ffn


def _inputs(num_ranks, tokens, *, dtype=F32, seed=0, shared_ffn=FS, router_bias=True):
  """Weights (with a shared expert and a router bias that skews the choice), `x [R * T, H]` and
  the output's cotangent."""
  k_p, k_x, k_c, k_b = jax.random.split(jax.random.key(seed), 4)
  params = jax_ep.init_moe_params(k_p, num_experts=E, hidden=H, ffn=F, dtype=dtype,
                                  shared_ffn=shared_ffn, router_bias=router_bias)
  if router_bias:
    params = params._replace(router_bias=0.3 * jax.random.normal(k_b, (E,), F32))
  x = jax.random.normal(k_x, (num_ranks * tokens, H), F32).astype(dtype)
  cot = jax.random.normal(k_c, x.shape, F32)
  return params, x, cot


@pytest.fixture(params=[None, "jax_ep"], ids=["xla_order", "own_stream"])
def comm_stream(request):
  """The group's `comm_stream`: None (XLA orders the micro-batches) or jax_ep's pipeline."""
  return request.param


def _group(new_group, num_ranks, tokens, dtype=F32, **options):
  return new_group(num_ranks, num_experts=E, num_topk=K, hidden=H, max_tokens=tokens,
                   dtype=dtype, **options)


def _rel(group, rel):
  """`rel` on the reference backend; on GPUs float32 products may round their inputs (TF32),
  which the sums in another order see more of."""
  return rel if group.backend_name == "reference" else max(rel, 1e-4)


def _step(group, topk_idx=None, **options):
  """One jitted step: the layer's `MoEOutput` and the gradients of `sum(out * cot) + aux + z`
  with respect to the weights, `x` and the given router weights (zeros where the router
  decides)."""
  def loss(params, x, topk_weights, cot):
    routing = () if topk_idx is None else (topk_idx, topk_weights)
    result = jax_ep.moe_mlp(group, params, x, *routing, **options)
    total = (jnp.sum(result.out.astype(F32) * cot) + jnp.mean(result.aux_loss)
             + jnp.mean(result.z_loss))
    return total, result
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _compare(group, split, unsplit, *, rel, exact_out, what):
  """The split layer's results (`(loss, MoEOutput), grads` of `_step`) against the unsplit
  one's: routing and statistics exactly, the output exactly (`exact_out`) or within `rel` of
  its scale, every gradient within `rel` of its scale."""
  (_, got), got_grads = split
  (_, want), want_grads = unsplit
  rel = _rel(group, rel)
  # Computed before the split, by the same operations: the same bits on the reference backend.
  same = np.testing.assert_array_equal if group.backend_name == "reference" else (
      lambda a, b, err_msg: np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=err_msg))
  for field in ("num_dropped", "expert_counts", "topk_idx"):
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                  err_msg=f"{what}: {field}")
  for field in ("aux_loss", "z_loss", "router_probs", "topk_weights"):
    a, b = getattr(got, field), getattr(want, field)
    assert (a is None) == (b is None), f"{what}: {field}"
    if a is not None:
      same(np.asarray(a, np.float64), np.asarray(b, np.float64), err_msg=f"{what}: {field}")
  assert got.out.dtype == want.out.dtype and got.out.shape == want.out.shape
  if exact_out and group.backend_name == "reference":
    np.testing.assert_array_equal(got.out, want.out, err_msg=f"{what}: out")
  else:
    assert_close_to_scale(got.out, want.out, rel, f"{what}: out")
  (g_params, g_x, g_w), (d_params, d_x, d_w) = got_grads, want_grads
  assert_close_to_scale(g_x, d_x, rel, f"{what}: grad x")
  if np.abs(np.asarray(d_w)).max() > 0:
    assert_close_to_scale(g_w, d_w, rel, f"{what}: grad topk_weights")
  for name, g, d in zip(MoEParams._fields, g_params, d_params):
    assert (g is None) == (d is None), name
    if g is None or name == "router_bias":  # the bias gets no gradient (selection only)
      continue
    assert g.dtype == d.dtype, f"{what}: grad {name} dtype {g.dtype} != {d.dtype}"
    if not np.asarray(d).any():  # the router's, where the routing is given
      np.testing.assert_array_equal(g, 0, err_msg=f"{what}: grad {name}")
      continue
    assert_close_to_scale(g, d, rel, f"{what}: grad {name}")


def _both(group, params, x, cot, micro_batches, topk_idx=None, topk_weights=None, **options):
  """`(split, unsplit)` results of `_step`."""
  w = jnp.zeros((x.shape[0], K), F32) if topk_weights is None else topk_weights
  args = (params, x, w, cot)
  split = _step(group, topk_idx, micro_batches=micro_batches, **options)(*args)
  unsplit = _step(group, topk_idx, **options)(*args)
  return split, unsplit


# ---------------------------------------------------------------------- values and gradients
@pytest.mark.parametrize("micro_batches", [2, 4])
@pytest.mark.parametrize("num_ranks", [1, 2, 8])
def test_split_layer_matches_unsplit(new_group, comm_stream, num_ranks, micro_batches):
  """Float32, the router deciding (skewed by its bias), a shared expert."""
  tokens = 16
  group = _group(new_group, num_ranks, tokens, comm_stream=comm_stream)
  params, x, cot = _inputs(num_ranks, tokens, seed=num_ranks)
  split, unsplit = _both(group, params, x, cot, micro_batches)
  _compare(group, split, unsplit, rel=1e-5, exact_out=True,
           what=f"R={num_ranks}, micro_batches={micro_batches}")
  np.testing.assert_array_equal(split[0][1].num_dropped, 0)  # the default capacity


def test_split_layer_matches_unsplit_in_bfloat16_per_sequence(new_group):
  """Bfloat16 weights and activations, `[B, S, H]` sequences whose per-sequence loss the
  micro-batches cut across (4 tokens each of a shard's two sequences of 8)."""
  num_ranks, batch, seq = 2, 4, 8
  group = _group(new_group, num_ranks, batch * seq // num_ranks, dtype=jnp.bfloat16)
  params, x, cot = _inputs(num_ranks, batch * seq // num_ranks, dtype=jnp.bfloat16, seed=5)
  x, cot = x.reshape(batch, seq, H), cot.reshape(batch, seq, H)
  split, unsplit = _both(group, params, x, cot, 4, aux_loss_scope="per_sequence")
  # The weights' gradients: each micro-batch's partial sum rounded to bfloat16 (the storage
  # dtype) before they are added.
  _compare(group, split, unsplit, rel=2e-2, exact_out=False, what="bf16 per_sequence")


@pytest.mark.parametrize("num_ranks,micro_batches,pattern", [(8, 4, "hot"), (2, 2, "duplicates")])
def test_split_layer_with_skewed_routing(new_group, comm_stream, num_ranks, micro_batches,
                                         pattern):
  """Given routing: every token's first slot on expert 0 ("hot"), or slots of one token that
  name one expert ("duplicates"); the gradient of the given router weights too."""
  tokens = 16
  group = _group(new_group, num_ranks, tokens, comm_stream=comm_stream)
  params, x, cot = _inputs(num_ranks, tokens, seed=7, shared_ffn=0, router_bias=False)
  rng = np.random.default_rng(3)
  idx = make_routing(rng, num_ranks, tokens, K, E, pattern).reshape(-1, K)
  w = jnp.asarray(rng.random(idx.shape).astype(np.float32))
  split, unsplit = _both(group, params, x, cot, micro_batches, jnp.asarray(idx), w)
  _compare(group, split, unsplit, rel=1e-5, exact_out=True, what=pattern)
  counts = np.asarray(split[0][1].expert_counts).sum(0)
  if pattern == "hot":
    assert counts[0] == num_ranks * tokens  # skewed as asked


def test_split_layer_with_expert_alignment(new_group):
  """Padding between the experts' rows in each micro-batch's dispatch."""
  num_ranks, tokens = 2, 16
  group = _group(new_group, num_ranks, tokens, expert_alignment=16)
  params, x, cot = _inputs(num_ranks, tokens, seed=11)
  split, unsplit = _both(group, params, x, cot, 2)
  _compare(group, split, unsplit, rel=1e-5, exact_out=True, what="expert_alignment=16")


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_split_layer_with_remat_saves_only_the_inputs(new_group, comm_stream, micro_batches):
  """`remat=True`: each micro-batch is its own checkpoint; the gradients are the unsplit
  layer's (without remat), and the backward keeps only the inputs (the micro-batches' slices
  of the tokens and the routing), never a dispatched row or a hidden activation."""
  num_ranks, tokens = 2, 16
  group = _group(new_group, num_ranks, tokens, comm_stream=comm_stream)
  params, x, cot = _inputs(num_ranks, tokens, seed=13)
  w = jnp.zeros((x.shape[0], K), F32)
  split = _step(group, micro_batches=micro_batches, remat=True)(params, x, w, cot)
  unsplit = _step(group)(params, x, w, cot)
  _compare(group, split, unsplit, rel=1e-5, exact_out=True, what="remat")

  idx, weights = jax_ep.route(x, params.router, K)

  def loss(params, x):
    out = jax_ep.moe_mlp(group, params, x, idx, weights, remat=True,
                         micro_batches=micro_batches).out
    return jnp.sum(out * cot)
  part = x.shape[0] // micro_batches
  inputs = ({x.shape, idx.shape, cot.shape, (part, H), (part, K)}
            | {p.shape for p in params if p is not None})
  kept = set(_residual_shapes(loss, params, x))
  assert kept <= inputs, f"remat with micro-batches saved {kept - inputs}"


@pytest.mark.parametrize("capacity", [None, 24], ids=["default", "tight"])
def test_group_sized_for_a_micro_batch(new_group, capacity):
  """A group whose `max_tokens_per_rank` is one micro-batch serves a shard of `n` times as
  many tokens. Each micro-batch's call has the group's whole capacity: with a tight one the
  split layer is the unsplit layer applied to each micro-batch's tokens on its own (the same
  outputs, and `num_dropped` the sum of theirs, at most what that capacity drops for the whole
  shard at once); with the default nothing drops, and it is the unsplit layer on a group sized
  for the whole shard."""
  num_ranks, tokens, micro_batches = 2, 16, 2
  part = tokens // micro_batches
  group = _group(new_group, num_ranks, part, capacity=capacity)
  params, x, _ = _inputs(num_ranks, tokens, seed=17)
  layer = jax.jit(lambda x, m: jax_ep.moe_mlp(group, params, x, micro_batches=m),
                  static_argnums=1)
  got = layer(x, micro_batches)
  with pytest.raises(ValueError, match="x has 16 tokens .* more than the group's "
                                       "max_tokens_per_rank=8"):
    layer(x, 1)  # one dispatch of the whole shard does not fit the group
  # Micro-batch i of every shard: rows [s * T + i * T/n, s * T + (i + 1) * T/n) of x.
  shards = x.reshape(num_ranks, micro_batches, part, H)
  parts = [layer(shards[:, i].reshape(-1, H), 1) for i in range(micro_batches)]
  want_out = np.stack([np.asarray(p.out).reshape(num_ranks, part, H) for p in parts], 1)
  exact = group.backend_name == "reference"
  check = np.testing.assert_array_equal if exact else (
      lambda a, b: assert_close_to_scale(a, b, _rel(group, 1e-5), "out"))
  check(np.asarray(got.out).reshape(num_ranks, micro_batches, part, H), want_out)
  np.testing.assert_array_equal(got.num_dropped, sum(np.asarray(p.num_dropped) for p in parts))
  if capacity is None:
    np.testing.assert_array_equal(got.num_dropped, 0)
    whole = _group(new_group, num_ranks, tokens)
    want = jax.jit(lambda x: jax_ep.moe_mlp(whole, params, x))(x)
    check(got.out, want.out)
  else:
    assert int(np.sum(got.num_dropped)) > 0  # the tight capacity does drop here
    # The same capacity for all of a shard's tokens at once drops at least as many rows.
    whole = _group(new_group, num_ranks, tokens, capacity=capacity)
    unsplit = jax.jit(lambda x: jax_ep.moe_mlp(whole, params, x))(x)
    assert (np.asarray(unsplit.num_dropped) >= np.asarray(got.num_dropped)).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_saved_residuals_are_micro_batches_times_memory_bytes(dtype):
  """What `jax.vjp` of the split layer keeps (weights aside), on a group sized for one
  micro-batch: `micro_batches` times `memory_bytes`' figures at that size, per rank, without
  and with `remat` (`jax_ep.memory_bytes`' docstring)."""
  num_ranks, tokens, micro_batches, ffn = 2, 128, 4, 96
  part = tokens // micro_batches
  group = make_group(num_ranks, num_experts=8, num_topk=2, hidden=64, max_tokens=part,
                     dtype=dtype)
  params = jax_ep.init_moe_params(jax.random.key(0), num_experts=8, hidden=64, ffn=ffn,
                                  dtype=dtype)
  x = jax.random.normal(jax.random.key(1), (num_ranks * tokens, 64)).astype(dtype)
  idx = jax.random.randint(jax.random.key(2), (num_ranks * tokens, 2), 0, 8, jnp.int32)
  w = jax.random.uniform(jax.random.key(3), (num_ranks * tokens, 2))
  weights = (params.w_gate, params.w_up, params.w_down)
  est = group.memory_bytes(ffn=ffn)
  for remat, figure in ((False, est.expert_activation_bytes),
                        (True, est.expert_activation_bytes_remat)):
    def moe(params, x, idx, w, remat=remat):
      return jax_ep.moe_mlp(group, params, x, idx, w, remat=remat,
                            micro_batches=micro_batches).out
    saved, left_out = _residual_bytes(moe, params, x, idx, w, exclude=weights)
    assert left_out == 3, remat  # the three expert weights
    assert saved == num_ranks * micro_batches * figure, remat


def test_split_layer_under_vmap(new_group, comm_stream):
  """A leading batch axis over the layer (vmap of the gradient): as the unsplit layer's."""
  num_ranks, tokens = 2, 8
  group = _group(new_group, num_ranks, tokens, comm_stream=comm_stream)
  rel = _rel(group, 1e-5)
  params, x, cot = _inputs(num_ranks, tokens, seed=19)
  xs = jnp.stack([x, -x, 0.5 * x])

  def grads(micro_batches):
    def loss(params, x):
      return jnp.sum(jax_ep.moe_mlp(group, params, x, micro_batches=micro_batches).out * cot)
    return jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=(None, 0)))(
        params, xs)
  (got_loss, (got_p, got_x)), (want_loss, (want_p, want_x)) = grads(2), grads(1)
  assert_close_to_scale(got_loss, want_loss, rel, "vmap loss")
  assert_close_to_scale(got_x, want_x, rel, "vmap grad x")
  for name in ("router", "w_gate", "w_up", "w_down", "shared_gate"):
    assert_close_to_scale(getattr(got_p, name), getattr(want_p, name), rel,
                          f"vmap grad {name}")


def test_split_layers_under_scan_and_per_shard(new_group, comm_stream):
  """`lax.scan` over two layers of stacked weights, each `moe_mlp_per_shard` inside one
  `shard_map` with `remat`: values and gradients as the unsplit stack's."""
  num_ranks, tokens, layers = 2, 16, 2
  group = _group(new_group, num_ranks, tokens, comm_stream=comm_stream)
  rel = _rel(group, 1e-5)
  stacked = [_inputs(num_ranks, tokens, seed=23 + i)[0] for i in range(layers)]
  params = jax.tree.map(lambda *p: jnp.stack(p), *stacked)
  _, x, cot = _inputs(num_ranks, tokens, seed=29)
  specs = MoEParams(*(None if s is None else P(None, *s) for s in param_specs("ep", params)))

  def stack(micro_batches):
    def body(params, x):
      def layer(h, p):
        out = jax_ep.moe_mlp_per_shard(group, p, h, remat=True, micro_batches=micro_batches)
        return h + out.out, out.num_dropped
      return jax.lax.scan(layer, x, params)
    run = jax.shard_map(body, mesh=group.mesh, in_specs=(specs, P("ep")),
                        out_specs=(P("ep"), P("ep")))

    def loss(params, x):
      laid_out = MoEParams(*(None if p is None else group.constrain(p, s)
                             for p, s in zip(params, specs)))
      out, dropped = run(laid_out, group.constrain(x, P("ep")))
      return jnp.sum(out * cot), (out, dropped)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  (_, (got, dropped)), (got_p, got_x) = stack(4)
  (_, (want, _)), (want_p, want_x) = stack(1)
  np.testing.assert_array_equal(dropped, 0)
  assert_close_to_scale(got, want, rel, "scan out")
  assert_close_to_scale(got_x, want_x, rel, "scan grad x")
  for name in ("router", "w_gate", "w_up", "w_down", "shared_gate", "shared_down"):
    assert_close_to_scale(getattr(got_p, name), getattr(want_p, name), rel,
                          f"scan grad {name}")


# ---------------------------------------------------------------------- the program
def _count_calls(jaxpr, rule: str) -> int:
  """Custom-VJP calls in `jaxpr` (and every jaxpr nested in it) whose backward rule is
  `rule` (`_dispatch_bwd`: `jax_ep.dispatch`, `_combine_weighted_bwd`: `jax_ep.combine`)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "custom_vjp_call" and rule in str(eqn.params.get("bwd"))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _count_calls(sub, rule)
  return count


def _is_communication(eqn) -> bool:
  """The reference backend's exchanges, and the cuda backend's custom calls."""
  return eqn.primitive.name in ("all_to_all", "ffi_call")


def _communication_depth(jaxpr, in_depths=None):
  """`(depth of each output, deepest)`: the most communication ops on any chain of data
  dependencies from the inputs. A nested jaxpr whose inputs and outputs are its equation's
  (`shard_map`, `jit`, `checkpoint`, custom-VJP calls) is followed through; any other (a
  loop) counts as one step of all its own depth."""
  in_depths = [0] * len(jaxpr.invars) if in_depths is None else in_depths
  depth = dict(zip(jaxpr.invars, in_depths))
  get = lambda v: 0 if isinstance(v, jax.extend.core.Literal) else depth.get(v, 0)  # noqa: E731
  deepest = max(in_depths, default=0)
  for eqn in jaxpr.eqns:
    ins = [get(v) for v in eqn.invars]
    subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
    if (len(subs) == 1 and len(subs[0].invars) == len(ins)
        and len(subs[0].outvars) == len(eqn.outvars)):
      outs, inner = _communication_depth(subs[0], ins)
    else:
      own = max((_communication_depth(s)[1] for s in subs), default=0) + _is_communication(eqn)
      outs = [max(ins, default=0) + own] * len(eqn.outvars)
      inner = max(outs, default=0)
    depth.update(zip(eqn.outvars, outs))
    deepest = max(deepest, inner)
  return [get(v) for v in jaxpr.outvars], deepest


def test_communication_depth_sees_chains():
  """The measure itself: two exchanges one after the other are two deep, side by side one."""
  mesh = jax.make_mesh((2,), ("ep",), devices=rank_devices(2),
                       axis_types=(jax.sharding.AxisType.Auto,))
  a2a = lambda v: jax.lax.all_to_all(v, "ep", 0, 0, tiled=True)  # noqa: E731
  run = lambda f: jax.shard_map(f, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))  # noqa: E731
  x = jnp.ones((8, 4))
  chained = jax.make_jaxpr(run(lambda v: a2a(a2a(v[:2]) + v[2:])))(x).jaxpr
  side_by_side = jax.make_jaxpr(run(lambda v: a2a(v[:2]) + a2a(v[2:])))(x).jaxpr
  assert _communication_depth(chained)[1] == 2
  assert _communication_depth(side_by_side)[1] == 1


def test_program_of_micro_batches(new_group):
  """`micro_batches=1` traces the unsplit program (one dispatch, one combine, no split);
  `n` trace `n` of each, and the longest chain of communication ops in the forward and in the
  training step (forward and backward) is the unsplit layer's: no micro-batch's exchange waits
  for another's."""
  num_ranks, tokens = 2, 16
  group = _group(new_group, num_ranks, tokens)
  params, x, cot = _inputs(num_ranks, tokens, seed=31)

  def programs(**options):
    forward = lambda p, x: jax_ep.moe_mlp(group, p, x, **options).out  # noqa: E731
    loss = lambda p, x: jnp.sum(forward(p, x) * cot)  # noqa: E731
    return (jax.make_jaxpr(forward)(params, x).jaxpr,
            jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x).jaxpr)

  plain_fwd, plain_step = programs()
  one_fwd, one_step = programs(micro_batches=1)
  assert str(one_fwd) == str(plain_fwd) and str(one_step) == str(plain_step)
  assert count_primitive(one_fwd, "split") == 0
  assert _count_calls(one_fwd, "_dispatch_bwd") == _count_calls(one_fwd,
                                                                "_combine_weighted_bwd") == 1
  for remat in (False, True):
    unsplit_fwd, unsplit_step = programs(remat=remat)
    depth_fwd = _communication_depth(unsplit_fwd)[1]
    depth_step = _communication_depth(unsplit_step)[1]
    assert depth_fwd >= 2 and depth_step >= depth_fwd  # dispatch, then combine
    for micro_batches in (2, 4):
      fwd, step = programs(micro_batches=micro_batches, remat=remat)
      what = f"micro_batches={micro_batches}, remat={remat}"
      assert count_primitive(fwd, "split") > 0, what
      assert _count_calls(fwd, "_dispatch_bwd") == micro_batches, what
      assert _count_calls(fwd, "_combine_weighted_bwd") == micro_batches, what
      assert _communication_depth(fwd)[1] == depth_fwd, what
      assert _communication_depth(step)[1] == depth_step, what


# ---------------------------------------------------------------------- errors
def test_micro_batches_errors():
  group = make_group(2, num_experts=E, num_topk=K, hidden=H, max_tokens=16, dtype=F32,
                     low_latency=True)
  params, x, _ = _inputs(2, 16, shared_ffn=0, router_bias=False)
  layer = lambda x=x, **kw: jax_ep.moe_mlp(group, params, x, **kw)  # noqa: E731
  for value, error, words in ((0, ValueError, "must be positive, got 0"),
                              (-2, ValueError, "must be positive, got -2"),
                              (True, TypeError, "must be an int, got True"),
                              (2.0, TypeError, r"must be an int, got 2.0 \(float\)"),
                              ("2", TypeError, "must be an int, got '2'")):
    with pytest.raises(error, match=f"jax_ep.moe_mlp: micro_batches {words}"):
      layer(micro_batches=value)
  with pytest.raises(ValueError, match=r"jax_ep.moe_mlp: micro_batches=3 must divide each "
                                       r"shard's token count, 16 \(x shape \(32, 32\) over the "
                                       r"mesh's 2 devices\)"):
    layer(micro_batches=3)
  with pytest.raises(ValueError, match=r"jax_ep.moe_mlp: micro_batches=2 with "
                                       r"mode='low_latency'"):
    layer(micro_batches=2, mode="low_latency")
  with pytest.raises(ValueError, match=r"jax_ep.moe_mlp: micro_batches=2 splits each shard's "
                                       r"40 tokens \(x shape \(80, 32\) over the mesh's 2 "
                                       r"devices\) into micro-batches of 20, more than the "
                                       r"group's max_tokens_per_rank=16"):
    layer(jnp.ones((80, H)), micro_batches=2)

  def per_shard(x, micro_batches):
    specs = param_specs("ep", params)
    run = jax.shard_map(
        lambda p, x: jax_ep.moe_mlp_per_shard(group, p, x, micro_batches=micro_batches).out,
        mesh=group.mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))
    laid_out = MoEParams(*(None if p is None else group.constrain(p, s)
                           for p, s in zip(params, specs)))
    return run(laid_out, group.constrain(x, P("ep")))
  with pytest.raises(ValueError, match=r"jax_ep.moe_mlp_per_shard: micro_batches=3 must divide "
                                       r"each shard's token count, 16 \(x shape \(16, 32\)\)"):
    per_shard(x, 3)
  with pytest.raises(TypeError, match="jax_ep.moe_mlp_per_shard: micro_batches must be an int"):
    per_shard(x, None)


# ---------------------------------------------------------------------- NNX module
def test_nnx_module_with_micro_batches():
  """`jax_ep.nnx.MoE(micro_batches=2)` on a ('data', 'expert') mesh: a training step's loss,
  gradients and statistics as the unsplit module's (the same weights); its decode calls run
  unsplit; the errors of a call that does not split."""
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE
  if jax.device_count() < 8 or jax.process_count() > 1:
    pytest.skip("a mesh of 8 devices in one process")
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  options = dict(num_experts=8, num_topk=2, hidden=H, dtype=F32, backend="reference")
  group = jax_ep.Group(mesh, "expert", max_tokens_per_rank=8, **options)
  decode_group = jax_ep.Group(mesh, "expert", max_tokens_per_rank=1, low_latency=True,
                              **options)
  split = MoE(group, ffn=F, rngs=nnx.Rngs(0), micro_batches=2, shared_ffn=FS,
              decode_group=decode_group)
  unsplit = MoE(group, ffn=F, rngs=nnx.Rngs(0), shared_ffn=FS)
  x = jax.random.normal(jax.random.key(37), (8 * 8, H), F32)
  cot = jax.random.normal(jax.random.key(41), x.shape, F32)

  @nnx.jit
  def step(model, x):
    def loss(model, x):
      return jnp.sum(model(x) * cot) + jnp.mean(model.aux_loss[...])
    return nnx.value_and_grad(loss, argnums=(0, 1))(model, x)
  got_loss, (got_model, got_x) = step(split, x)
  want_loss, (want_model, want_x) = step(unsplit, x)
  assert_close_to_scale(got_loss, want_loss, 1e-6, "nnx loss")
  assert_close_to_scale(got_x, want_x, 1e-5, "nnx grad x")
  for name in ("router", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down"):
    assert_close_to_scale(getattr(got_model, name)[...], getattr(want_model, name)[...], 1e-5,
                          f"nnx grad {name}")
  for name in ("num_dropped", "aux_loss", "z_loss", "expert_counts"):
    np.testing.assert_array_equal(getattr(split, name)[...], getattr(unsplit, name)[...],
                                  err_msg=name)

  one = x[:8]  # decode: one token per device, which two micro-batches could not split
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x, mode="low_latency"))(split, one),
                             unsplit(one), rtol=1e-5, atol=1e-6)

  with pytest.raises(ValueError, match=r"jax_ep.nnx.MoE: micro_batches=2 must divide each "
                                       r"shard's token count, 1 \(x shape \(8, 32\) over the "
                                       r"mesh's 8 devices\)"):
    split(one)
  with pytest.raises(ValueError, match=r"jax_ep.nnx.MoE: micro_batches=2 splits each shard's "
                                       r"32 tokens .* into micro-batches of 16, more than the "
                                       r"group's max_tokens_per_rank=8"):
    split(jnp.ones((8 * 32, H)))
  with pytest.raises(ValueError, match="jax_ep.nnx.MoE: micro_batches must be positive, got 0"):
    MoE(group, ffn=F, rngs=nnx.Rngs(0), micro_batches=0)


def test_nnx_scanned_layers_with_micro_batches():
  """Flax's scan-over-layers recipe (blocks built under `nnx.vmap`, run under `nnx.scan` with
  `nnx.remat`), each block's MoE split into two micro-batches: the training step's loss and
  gradients as the unsplit stack's."""
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE
  if jax.device_count() < 8 or jax.process_count() > 1:
    pytest.skip("a mesh of 8 devices in one process")
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  group = jax_ep.Group(mesh, "expert", num_experts=8, num_topk=2, hidden=H,
                       max_tokens_per_rank=8, dtype=F32, backend="reference")
  layers = 2

  class Stack(nnx.Module):
    def __init__(self, micro_batches, rngs):
      @nnx.split_rngs(splits=layers)
      @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
      def blocks(rngs):
        return MoE(group, ffn=F, rngs=rngs, micro_batches=micro_batches)
      self.blocks = blocks(rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      @nnx.remat
      def body(x, block):
        return x + block(x)
      return body(x, self.blocks)

  x = jax.random.normal(jax.random.key(43), (8 * 8, H), F32)
  target = jax.random.normal(jax.random.key(47), x.shape, F32)

  @nnx.jit
  def step(model, x):
    return nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
  with jax.set_mesh(mesh):
    split, unsplit = Stack(2, nnx.Rngs(0)), Stack(1, nnx.Rngs(0))
    (got_loss, got), (want_loss, want) = step(split, x), step(unsplit, x)
  assert_close_to_scale(got_loss, want_loss, 1e-6, "scanned loss")
  for name in ("router", "w_gate", "w_up", "w_down"):
    assert_close_to_scale(getattr(got.blocks, name)[...], getattr(want.blocks, name)[...], 1e-5,
                          f"scanned grad {name}")
  np.testing.assert_array_equal(split.blocks.expert_counts[...], unsplit.blocks.expert_counts[...])
