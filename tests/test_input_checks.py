"""Bad input never gives wrong numbers: each public function refuses what it cannot take with a
`ValueError` / `TypeError` that names the argument as the caller wrote it, or counts what only
the device can see in a statistic the docs name.

The checks that reach a group's backend run on the reference backend here and on the cuda
backend at one rank in `TestInputChecksCuda` (marked `gpu`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_test_base import CUDA_LOCAL, REFERENCE, BackendSuite, host_value, rank_mesh

MEMORY = dict(num_ranks=8, num_experts=16, num_topk=2, hidden=64, max_tokens_per_rank=8)


# ------------------------------------------------------------------ memory_bytes, Group's rule

@pytest.mark.parametrize("kwargs,error,message", [
    (dict(num_experts=12), ValueError, r"num_experts=12 must be divisible by num_ranks=8"),
    (dict(hidden=-64), ValueError, r"hidden must be positive, got -64"),
    (dict(backend="cdua"), ValueError, r"backend must be 'reference' or 'cuda' .*got 'cdua'"),
    (dict(num_topk=40), ValueError, r"num_topk=40 must be <= num_experts=16"),
    (dict(num_ranks=0), ValueError, r"num_ranks must be positive, got 0"),
    (dict(num_ranks=2.0), TypeError, r"num_ranks must be an int, got 2.0"),
    (dict(max_tokens_per_rank=True), TypeError, r"max_tokens_per_rank must be an int, got True"),
    (dict(dtype=jnp.int8), TypeError, r"dtype must be one of bfloat16, float16, float32"),
])
def test_memory_bytes_takes_what_a_group_takes(kwargs, error, message):
  with pytest.raises(error, match="jax_ep.memory_bytes: " + message):
    jax_ep.memory_bytes(**dict(MEMORY, **kwargs))


@pytest.mark.parametrize("kwargs", [
    dict(num_experts=0), dict(hidden=-64), dict(num_topk=40), dict(max_tokens_per_rank=2.5),
    dict(dtype=jnp.int8), dict(expert_alignment=0), dict(capacity=0),
    dict(capacity=64, buffer_factor=1.0)])
def test_memory_bytes_refuses_what_a_group_refuses_in_the_same_words(kwargs):
  mesh = jax.make_mesh((8,), ("ep",), devices=jax.devices()[:8])
  config = dict(MEMORY, **kwargs)
  config.pop("num_ranks")
  with pytest.raises((ValueError, TypeError)) as by_group:
    jax_ep.Group(mesh, "ep", backend="reference", **config)
  with pytest.raises(by_group.type) as by_memory:
    jax_ep.memory_bytes(**dict(MEMORY, **kwargs))
  assert (str(by_memory.value).removeprefix("jax_ep.memory_bytes: ")
          == str(by_group.value).removeprefix("jax_ep.Group: "))


# ------------------------------------------------------------------ the ops and the layer

E, K, H, T, F = 16, 2, 32, 8, 16


def _struct(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _params(num_experts=E, hidden=H, ffn=F, **overrides):
  """Abstract `MoEParams` (the layer's checks run before any arithmetic)."""
  params = jax_ep.MoEParams(
      router=_struct((hidden, num_experts)), w_gate=_struct((num_experts, hidden, ffn)),
      w_up=_struct((num_experts, hidden, ffn)), w_down=_struct((num_experts, ffn, hidden)),
      router_bias=_struct((num_experts,)), shared_gate=_struct((hidden, 8)),
      shared_up=_struct((hidden, 8)), shared_down=_struct((8, hidden)))
  return params._replace(**overrides)


# (what is wrong, the params' replaced fields, the words of the error). The per-rank body sees
# the expert weights' local slices: `[L, ...]`.
LAYER_PARAMS = [
    ("router_of_2E", dict(router=_struct((H, 2 * E))),
     r"params.router must have shape \[H, E\] = \(32, 16\), got shape \(32, 32\)"),
    ("router_hidden", dict(router=_struct((H + 1, E))),
     r"params.router must have shape \[H, E\] = \(32, 16\), got shape \(33, 16\)"),
    ("w_gate_hidden", dict(w_gate=_struct((E, H + 1, F))),
     r"params.w_gate must have shape \[{e}, H, F\] = \({n}, 32, F\), got shape \({n2}, 33, 16\)"),
    ("w_down_ffn", dict(w_down=_struct((E, F + 1, H))),
     r"params.w_down must have shape \[{e}, F, H\] = \({n}, 16, 32\), got shape \({n2}, 17, 32\)"),
    ("w_up_of_2E", dict(w_up=_struct((2 * E, H, F))),
     r"params.w_up must have shape \[{e}, H, F\] = \({n}, 32, 16\), got shape \({n3}, 32, 16\)"),
    ("router_bias", dict(router_bias=_struct((2 * E,))),
     r"params.router_bias must have shape \[E\] = \(16\), got shape \(32,\)"),
    ("shared_down", dict(shared_down=_struct((8, H + 1))),
     r"params.shared_down must have shape \[Fs, H\] = \(8, 32\), got shape \(8, 33\)"),
    ("shared_alone", dict(shared_down=None),
     r"params.shared_gate and params.shared_down make the shared expert together"),
]


class InputChecks(BackendSuite):
  """The checks that take a group, on the target's backend at its `small_ranks` ranks."""

  @property
  def num_ranks(self):
    return self.small_ranks

  def group(self, **overrides):
    kwargs = dict(num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=jnp.float32)
    return self.make_group(self.num_ranks, **{**kwargs, **overrides})

  def trace(self, group, fn, *shapes):
    """Traces `fn` on one rank's `[T, ...]` inputs of these shapes, inside shard_map."""
    specs = P("ep")
    mapped = jax.shard_map(lambda *a: fn(*(b[0] for b in a)), mesh=group.mesh, in_specs=specs,
                           out_specs=P(), check_vma=False)
    structs = [jax.ShapeDtypeStruct((group.num_ranks, *s), d,
                                    sharding=jax.NamedSharding(group.mesh, specs))
               for s, d in shapes]
    jax.jit(mapped).trace(*structs)

  tokens = ((T, H), jnp.float32), ((T, K), jnp.int32), ((T, K), jnp.float32)

  # -------------------------------------------------------------- handles
  @pytest.mark.parametrize("other", [dict(num_topk=4), dict(capacity=8), {}],
                           ids=["other_topk", "other_capacity", "same_configuration"])
  def test_combine_refuses_a_handle_of_another_group(self, other):
    made, other = self.group(), self.group(**other)

    def fn(x, idx, w):
      recv, handle = jax_ep.dispatch(made, x, idx, w)
      y = jnp.zeros((other.capacity, H), jnp.float32)
      return jax_ep.combine(other, y, handle).sum()
    with pytest.raises(ValueError, match=r"jax_ep.combine: handle was made by jax_ep.dispatch on "
                                         r"another group, jax_ep.Group\(.*\); this call's group "
                                         r"is jax_ep.Group\("):
      self.trace(made, fn, *self.tokens)

  def test_combine_takes_its_own_handle_across_programs(self):
    """The origin is static: it survives a handle returned from one program and passed to
    another, and the right group still combines."""
    group = self.group()
    other = self.group()
    sharding = jax.NamedSharding(group.mesh, P("ep"))
    x = jax.device_put(np.ones((self.num_ranks * T, H), np.float32), sharding)
    idx = jax.device_put(np.zeros((self.num_ranks * T, K), np.int32), sharding)
    w = jax.device_put(np.full((self.num_ranks * T, K), 0.5, np.float32), sharding)

    def send(x, idx, w):
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      return recv.x, handle
    rows, handle = jax.jit(jax.shard_map(send, mesh=group.mesh, in_specs=P("ep"),
                                         out_specs=P("ep")))(x, idx, w)
    for g in (group, other):
      back = jax.jit(jax.shard_map(lambda y, h, g=g: jax_ep.combine(g, y, h),
                                   mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))
      if g is other:
        with pytest.raises(ValueError, match="handle was made by jax_ep.dispatch on another"):
          back(rows, handle)
      else:
        np.testing.assert_array_equal(host_value(back(rows, handle)), host_value(x))

  def test_combine_refuses_a_handle_made_by_hand(self):
    group = self.group()

    def fn(x, idx, w):
      _, handle = jax_ep.dispatch(group, x, idx, w)
      forged = jax_ep.Handle(handle.layout, handle.topk_weights)
      return jax_ep.combine(group, jnp.zeros((group.capacity, H)), forged).sum()
    with pytest.raises(TypeError, match="jax_ep.combine: handle must be what jax_ep.dispatch "
                                        "returned; this one does not say which group made it"):
      self.trace(group, fn, *self.tokens)

  @pytest.mark.parametrize("op", ["low_latency_combine", "low_latency_combine_send",
                                  "low_latency_combine_wait", "low_latency_dispatch_wait"])
  def test_low_latency_ops_refuse_another_groups_handle(self, op):
    made, other = self.group(low_latency=True), self.group(low_latency=True, num_topk=4)
    slabs = jnp.zeros((other.num_local_experts, other.num_ranks * T, H), jnp.float32)

    def fn(x, idx, w):
      if op == "low_latency_dispatch_wait":
        return jax_ep.low_latency_dispatch_wait(
            other, jax_ep.low_latency_dispatch_send(made, x, idx))[0].count.sum()
      _, handle = jax_ep.low_latency_dispatch(made, x, idx)
      if op == "low_latency_combine":
        return jax_ep.low_latency_combine(other, slabs, handle, w).sum()
      if op == "low_latency_combine_send":
        return jax_ep.low_latency_combine_send(other, slabs, handle)
      sent = jax_ep.low_latency_combine_send(made, slabs, handle)
      return jax_ep.low_latency_combine_wait(other, sent, w).sum()
    made_by = {"low_latency_combine_wait": "sent was made by jax_ep.low_latency_combine_send",
               "low_latency_dispatch_wait": "sent was made by jax_ep.low_latency_dispatch_send"
               }.get(op, "handle was made by jax_ep.low_latency_dispatch")
    with pytest.raises(ValueError, match=rf"jax_ep.{op}: {made_by} on another group"):
      self.trace(made, fn, *self.tokens)

  # -------------------------------------------------------------- router weights
  def test_dispatch_needs_topk_weights(self):
    group = self.group()
    with pytest.raises(TypeError, match=r"jax_ep.dispatch: topk_weights must be an array "
                                        r"\[T, K\], got None"):
      self.trace(group, lambda x, idx, w: jax_ep.dispatch(group, x, idx, None)[0].x.sum(),
                 *self.tokens)

  def test_low_latency_combine_needs_topk_weights(self):
    group = self.group(low_latency=True)

    def fn(x, idx, w):
      recv, handle = jax_ep.low_latency_dispatch(group, x, idx)
      return jax_ep.low_latency_combine(group, recv.x, handle, None).sum()
    with pytest.raises(TypeError, match=r"jax_ep.low_latency_combine: topk_weights must be an "
                                        r"array \[T, K\], got None"):
      self.trace(group, fn, *self.tokens)

  # -------------------------------------------------------------- the layer
  @pytest.mark.parametrize("case,fields,message", LAYER_PARAMS,
                           ids=[c[0] for c in LAYER_PARAMS])
  def test_moe_mlp_names_the_param(self, case, fields, message):
    group = self.group()
    x = _struct((self.num_ranks * T, H))
    run = lambda p, x: jax_ep.moe_mlp(group, p, x)  # noqa: E731
    jax.eval_shape(run, _params(), x)  # the params these cases break are fine
    with pytest.raises(ValueError, match="jax_ep.moe_mlp: " + message.format(
        e="E", n=E, n2=E, n3=2 * E)):
      jax.eval_shape(run, _params(**fields), x)

  @pytest.mark.parametrize("case,fields,message", LAYER_PARAMS,
                           ids=[c[0] for c in LAYER_PARAMS])
  def test_moe_mlp_per_shard_names_the_param(self, case, fields, message):
    group = self.group()
    local = E // self.num_ranks
    # The body's params: the router, bias and shared expert whole, the experts' local slices.
    params = _params(**fields)
    experts = {n: getattr(params, n) for n in ("w_gate", "w_up", "w_down")}
    params = params._replace(**{n: _struct((a.shape[0] // self.num_ranks, *a.shape[1:]))
                                for n, a in experts.items()})

    def fn(x, idx, w):
      return jax_ep.moe_mlp_per_shard(group, params, x).out.sum()
    with pytest.raises(ValueError, match="jax_ep.moe_mlp_per_shard: " + message.format(
        e="L", n=local, n2=local, n3=2 * local)):
      self.trace(group, fn, *self.tokens)

  @pytest.mark.parametrize("x,routing,message", [
      ((T * 2, H + 1), (), r"x must have the group's hidden size H = 32 as its last "
                           r"dimension, got shape \(16, 33\)"),
      ((T * 2, H), ((T * 2, K + 1), (T * 2, K + 1)),
       r"topk_idx must have shape \[N, K\] = \(16, 2\), got shape \(16, 3\)"),
      ((2, T, H), ((2, T, K), (2, T, 1)),
       r"topk_weights must have shape \[B, S, K\] = \(2, 8, 2\), got shape \(2, 8, 1\)"),
      ((T * 2, H), ((T * 2, K), None), r"topk_idx is given without topk_weights"),
      ((T * 2, H), (None, (T * 2, K)), r"topk_weights is given without topk_idx"),
  ], ids=["x_hidden", "topk_idx_K", "topk_weights_K", "no_weights", "no_ids"])
  def test_moe_mlp_names_the_tokens(self, x, routing, message):
    group = self.group()
    x = _struct((x[0] * self.num_ranks // 2, *x[1:]))
    args = [None if s is None else _struct((s[0] * self.num_ranks // 2, *s[1:]),
                                           jnp.int32 if i == 0 else jnp.float32)
            for i, s in enumerate(routing)]
    with pytest.raises(ValueError, match="jax_ep.moe_mlp: " + message.replace(
        "(16", f"({T * self.num_ranks}").replace(r"\(2, 8", rf"\({self.num_ranks}, 8")):
      jax.eval_shape(lambda p, x, *r: jax_ep.moe_mlp(group, p, x, *r), _params(), x, *args)

  # -------------------------------------------------------------- grouped_matmul, eagerly
  @pytest.mark.parametrize("sizes,offsets,message", [
      ([4, 4, 6, 6], None, r"group_sizes must sum to at most x's 16 rows, got \[4, 4, 6, 6\] "
                           r"\(sum 20\)"),
      ([4, -2, 6, 6], None, r"group_sizes must be >= 0, got \[4, -2, 6, 6\]"),
      ([4, 4, 4, 4], [0, 4, 8, 14], r"every group must end inside x's 16 rows, got "
                                    r"group_offsets \+ group_sizes = \[4, 8, 12, 18\]"),
      ([4, 4, 4, 0], [0, 2, 8, 12], r"the groups must be ascending and disjoint"),
      ([4, 4, 4, 4], [-1, 4, 8, 12], r"group_offsets must be >= 0, got \[-1, 4, 8, 12\]"),
  ], ids=["sum_past_rows", "negative_size", "offset_past_rows", "overlapping", "negative_offset"])
  def test_grouped_matmul_checks_known_groups(self, sizes, offsets, message):
    device = rank_mesh(1).devices.flat[0]
    put = lambda a, dtype=jnp.int32: jax.device_put(jnp.asarray(a, dtype), device)  # noqa: E731
    x, w = put(np.ones((16, 64)), jnp.bfloat16), put(np.ones((4, 64, 64)), jnp.bfloat16)
    with pytest.raises(ValueError, match="jax_ep.grouped_matmul: " + message):
      jax_ep.grouped_matmul(x, w, put(sizes),
                            group_offsets=None if offsets is None else put(offsets))
    if offsets is None:  # the experts name the same argument
      with pytest.raises(ValueError, match="jax_ep.expert_mlp: " + message):
        jax_ep.expert_mlp(x, w, w, w, put(sizes))


# ------------------------------------------------------------------ without a group

@pytest.mark.parametrize("x,router,kwargs,error,message", [
    ((T, H + 1), (H, E), {}, ValueError,
     r"x must be \[T, H\] with the router's H = 32 \(router shape \(32, 16\)\), got shape "
     r"\(8, 33\)"),
    ((T, H), (H,), {}, ValueError, r"router must have shape \[H, E\], got shape \(32,\)"),
    ((T, H), (H, E), dict(num_topk=E + 1), ValueError,
     r"num_topk=17 must be <= the router's E = 16 experts"),
    ((T, H), (H, E), dict(num_topk=0), ValueError, r"num_topk must be positive, got 0"),
    ((T, H), (H, E), dict(bias=_struct((2 * E,))), ValueError,
     r"bias must have shape \[E\] = \(16,\) \(router shape \(32, 16\)\), got \(32,\)"),
], ids=["x_hidden", "router_1d", "topk_past_E", "topk_0", "bias"])
def test_route_names_the_argument(x, router, kwargs, error, message):
  kwargs = dict(dict(num_topk=K), **kwargs)
  with pytest.raises(error, match="jax_ep.route: " + message):
    jax.eval_shape(lambda x, r: jax_ep.route(x, r, **kwargs), _struct(x), _struct(router))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(ffn=0), ValueError, r"ffn must be positive, got 0"),
    (dict(ffn=2.5), TypeError, r"ffn must be an int, got 2.5"),
    (dict(hidden=-1), ValueError, r"hidden must be positive, got -1"),
    (dict(num_experts=0), ValueError, r"num_experts must be positive, got 0"),
    (dict(shared_ffn=-1), ValueError, r"shared_ffn must be >= 0 \(0: no shared expert\), got -1"),
    (dict(dtype=jnp.int8), TypeError, r"dtype \(the experts' storage dtype\) must be a "
                                      r"floating-point dtype, got int8"),
])
def test_init_moe_params_names_the_size(kwargs, error, message):
  kwargs = dict(dict(num_experts=E, hidden=H, ffn=F), **kwargs)
  with pytest.raises(error, match="jax_ep.init_moe_params: " + message):
    jax_ep.init_moe_params(jax.random.key(0), **kwargs)


def test_nnx_moe_names_ffn():
  nnx = pytest.importorskip("flax.nnx")
  from jax_ep.nnx import MoE
  group = jax_ep.Group(rank_mesh(2), "ep", num_experts=E, num_topk=K, hidden=H,
                       max_tokens_per_rank=T, backend="reference")
  with pytest.raises(ValueError, match=r"ffn must be positive, got -1"):
    MoE(group, ffn=-1, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("weights,message", [
    (((4, 65, 64), None, (4, 64, 64)),
     r"w_gate must have shape \[G, H, F\] = \(G, 64, F\), got shape \(4, 65, 64\)"),
    (((4, 64, 64), (8, 64, 64), (4, 64, 64)),
     r"w_up must have shape \[G, H, F\] = \(4, 64, 64\), got shape \(8, 64, 64\)"),
    (((4, 64, 32), (4, 64, 32), (4, 64, 64)),
     r"w_down must have shape \[G, F, H\] = \(4, 32, 64\), got shape \(4, 64, 64\)"),
], ids=["w_gate", "w_up", "w_down"])
def test_expert_mlp_names_the_weight(weights, message):
  activation = "swiglu" if weights[1] is not None else "gelu"
  w_gate, w_up, w_down = (None if s is None else _struct(s, jnp.bfloat16) for s in weights)
  with pytest.raises(ValueError, match="jax_ep.expert_mlp: " + message):
    jax.eval_shape(lambda *a: jax_ep.expert_mlp(*a, activation=activation),
                   _struct((16, 64), jnp.bfloat16), w_gate, w_up, w_down,
                   _struct((4,), jnp.int32))


def test_grouped_matmul_under_jit_checks_traced_groups_on_request():
  """Traced sizes are unknown when the program is built: unchecked by default (the program
  carries no check, so jax.export serialises it), checked on the device by the same rules in
  a program traced inside `check_traced_groups` and run under `checkify.checkify`."""
  from jax import export
  from jax.experimental import checkify
  from jax_ep.gmm import check_traced_groups
  x, w = jnp.ones((16, 64), jnp.bfloat16), jnp.ones((4, 64, 64), jnp.bfloat16)
  past_rows = jnp.array([4, 4, 6, 6], jnp.int32)
  product = lambda *a: jax_ep.grouped_matmul(*a)  # noqa: E731
  assert jax.jit(product)(x, w, past_rows).shape == (16, 64)
  export.export(jax.jit(product))(x, w, past_rows).serialize()
  with check_traced_groups():
    # A function of its own: jax reuses the trace of one already traced outside the block.
    checked = checkify.checkify(jax.jit(lambda *a: jax_ep.grouped_matmul(*a)),
                                errors=checkify.user_checks)
    error, _ = checked(x, w, past_rows)
    fine, _ = checked(x, w, jnp.array([4, 4, 4, 4], jnp.int32))
  with pytest.raises(checkify.JaxRuntimeError, match=r"jax_ep.grouped_matmul: group_sizes must "
                                                     r"sum to at most x's 16 rows"):
    error.throw()
  assert fine.get() is None


@pytest.mark.parametrize("capacity,expert_alignment", [(None, 1), (None, 3), (12, 3)],
                         ids=["default", "aligned", "aligned_dropping"])
def test_dispatch_layouts_pass_the_traced_group_checks(capacity, expert_alignment):
  """Every layout dispatch gives (padding between experts, experts cut off by a full buffer)
  follows the rules the checks hold the experts' groups to, forward and backward. (checkify
  takes shard_map over Auto mesh axes.)"""
  from jax.experimental import checkify
  from jax.sharding import AxisType
  from jax_ep.gmm import check_traced_groups
  mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
  group = jax_ep.Group(mesh, "ep", num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T,
                       dtype=jnp.float32, backend="reference", capacity=capacity,
                       expert_alignment=expert_alignment)
  params = jax_ep.init_moe_params(jax.random.key(0), num_experts=E, hidden=H, ffn=F,
                                  dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(1), (2 * T, H))

  def loss(params, x):
    result = jax_ep.moe_mlp(group, params, x)
    return result.out.sum(), result.num_dropped.sum()
  with check_traced_groups():
    error, ((_, dropped), _) = checkify.checkify(
        jax.jit(jax.value_and_grad(loss, has_aux=True)), errors=checkify.user_checks)(params, x)
  assert error.get() is None
  assert (int(dropped) > 0) == (capacity is not None)


class TestInputChecks(InputChecks):
  target = REFERENCE


@pytest.mark.gpu
class TestInputChecksCuda(InputChecks):
  target = CUDA_LOCAL
