"""The fused expert MLP (jax_ep/experts/mlp.py) against the unfused float32 model.

On Hopper `jax_ep.expert_mlp` runs gate and up as one kernel whose epilogue applies the
activation, the down projection in bf16, and a backward whose kernels fuse the activation's
derivative: no pass over the whole buffer. Rows outside the groups hold NaN in every test: no
result or gradient may change.

On the CPU the kernels run in Pallas's Mosaic GPU interpreter (as tests/test_grouped_matmul.py
does): what that checks is the logic (the passes, the epilogues, the loaded tiles, the stores
that stop at the groups, vmap's folds, the typing inside shard_map), not the GPU. The
`gpu`-marked tests run the compiled kernels at the models' shapes.
"""

import functools

import numpy as np
import jax
import jax.extend
import jax.numpy as jnp
import pytest

import jax_ep
from ep_test_base import grouped_matmul_kernels, require_hopper
from jax_ep import experts
from jax_ep.experts import choice, mlp
from jax_ep.experts.configs import KernelTiles
from jax_ep.experts.layout import rows_inside_groups

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SMALL = KernelTiles(64, 64, 64, 2, 1)
ACTIVATIONS = ("swiglu", "geglu", "gelu", "silu")


def as_on_hopper(monkeypatch):
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  monkeypatch.setattr(choice, "mosaic_compile_error", lambda *args: None)
  monkeypatch.setattr(mlp, "fused_compile_error", lambda *args: None)


@pytest.fixture
def interpreted(monkeypatch):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  as_on_hopper(monkeypatch)
  # The persistent kernels on 8 CTAs: the interpreter runs every CTA of a grid, idle ones too,
  # and a device's 132 would be most of a test's time.
  with plgpu.force_gpu_interpret_mode(), experts.override(
      gemm_tiles=SMALL, weight_grad_tiles=SMALL, fused_tiles=SMALL, kernel_sms=8):
    yield


def make_case(rng, rows, groups, hidden, ffn, sizes, activation, alignment=1,
              dtype=jnp.bfloat16, weights=None):
  """Weights (or the given ones), rows with NaN outside the groups, the groups (at offsets
  aligned to `alignment`), and a cotangent that is zero outside them. Drawn on the device in
  `dtype` (the models' shapes hold billions of values)."""
  sizes = np.asarray(sizes, np.int32)
  padded = -(-sizes // alignment) * alignment
  offsets = (np.cumsum(padded) - padded).astype(np.int32)
  assert offsets[-1] + sizes[-1] <= rows
  keys = iter(jax.random.split(jax.random.key(int(rng.integers(2 ** 31))), 5))
  normal = lambda scale, *shape: (jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
                                  * scale).astype(dtype)
  gated = activation in mlp.GATED
  if weights is None:
    weights = (normal(hidden ** -0.5, groups, hidden, ffn),
               normal(hidden ** -0.5, groups, hidden, ffn) if gated else None,
               normal(ffn ** -0.5, groups, ffn, hidden))
  gs, go = jnp.asarray(sizes), jnp.asarray(offsets)
  inside = rows_inside_groups(gs, go, rows)[:, None]
  x = jnp.where(inside, normal(1.0, rows, hidden), jnp.nan).astype(dtype)
  cot = jnp.where(inside, normal(1.0, rows, hidden), 0.0).astype(dtype)
  return x, weights, gs, go, cot, np.asarray(inside[:, 0])


def _group_model(activation):
  base = jax.nn.silu if activation in ("swiglu", "silu") else jax.nn.gelu

  def model(x, wg, wu, wd):
    gate = x @ wg
    h = base(gate) * (x @ wu) if wu is not None else base(gate)
    return h @ wd
  return model


def _bucket(size: int) -> int:
  return max(128, 1 << (max(size, 1) - 1).bit_length())


def _tolerance_errors(got, want, compared, rtol):
  """(elements outside `|got - want| <= rtol * (max|want| + |want|)` among `compared`, a
  non-finite `got` included; the non-finite ones; the largest finite difference; max|want|):
  np.testing's `assert_allclose(rtol=rtol, atol=rtol * max|want|)`, on the device."""
  got, want = got.astype(jnp.float32), want.astype(jnp.float32)
  scale = jnp.max(jnp.where(compared, jnp.abs(want), 0.0))
  scale = jnp.where(scale > 0, scale, 1.0)
  diff = jnp.abs(got - want)
  bad = compared & ~(diff <= rtol * (scale + jnp.abs(want)))
  finite = jnp.isfinite(got)
  return (jnp.sum(bad), jnp.sum(compared & ~finite),
          jnp.max(jnp.where(compared & finite, diff, 0.0)), scale)


@functools.partial(jax.jit, static_argnames=("activation", "bucket", "rtol", "batched"))
def _group_errors(y, grads, x, weights, cot, start, size, g, b, *, activation, bucket, rtol,
                  batched):
  """`_tolerance_errors` of one group's `y`, `dx` and weight gradients against the unfused
  float32 model of that group: its rows are read as a `bucket`-row window (zero rows with a
  zero cotangent add nothing to the weight gradients), so that one program per bucket serves
  every group. `x`, `y`, `dx` and `cot` hold at least `bucket` rows. With `batched`, `y` and
  the gradients are stacked over a leading axis and case `b`'s are compared: indexed here,
  where only the group's slice is read (a case's weight gradients at DeepSeek-V3's shape are
  22 GB, which a copy outside would need beside them)."""
  if batched:
    y, grads = y[b], (grads[0][b], *grads[1:])
  rows = x.shape[0]
  first = jnp.clip(start, 0, rows - bucket)  # the window, inside the rows
  row = first + jnp.arange(bucket)
  inside = ((row >= start) & (row < start + size))[:, None]
  window = lambda a: jax.lax.dynamic_slice_in_dim(a, first, bucket, 0)  # noqa: E731
  f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
  want_y, vjp = jax.vjp(_group_model(activation), jnp.where(inside, f32(window(x)), 0.0),
                        *(None if w is None else f32(w[g]) for w in weights))
  want = vjp(jnp.where(inside, f32(window(cot)), 0.0))
  errors = {"y": _tolerance_errors(window(y), want_y, inside, rtol),
            "dx": _tolerance_errors(window(grads[0]), want[0], inside, rtol)}
  for name, got, w in zip(("dw_gate", "dw_up", "dw_down"), grads[1:], want[1:]):
    if w is not None:
      errors[name] = _tolerance_errors(got[b, g] if batched else got[g], w, True, rtol)
  return errors


def check_against_reference(y, grads, x, weights, gs, go, cot, activation, what="",
                            rtol=3e-2, batch=None):
  """Compares `y` and the gradients `(dx, dw_gate, dw_up, dw_down)` with the unfused float32
  model, one group at a time (so that the models' shapes fit beside the results) and on the
  device (only counts come back): rows inside the groups, every expert's weight gradient.
  With `batch`, `y` and the gradients are stacked over cases and case `batch`'s compared."""
  assert y.dtype == jnp.bfloat16
  for name, got, w in zip(("dw_gate", "dw_up", "dw_down"), grads[1:], weights):
    assert (got is None) == (w is None), name
    assert got is None or got.dtype == jnp.bfloat16, name
  sizes = np.asarray(gs)
  bucket_max = _bucket(int(sizes.max()))
  if bucket_max > x.shape[0]:  # a window wider than the rows (small cases): zero rows past them
    assert batch is None, "a batched check pads nothing"
    pad = lambda a: None if a is None else jnp.pad(  # noqa: E731
        a, ((0, bucket_max - x.shape[0]), (0, 0)))
    y, x, cot, grads = pad(y), pad(x), pad(cot), (pad(grads[0]), *grads[1:])
  for g, (start, size) in enumerate(zip(np.asarray(go), sizes)):
    errors = jax.device_get(_group_errors(
        y, grads, x, weights, cot, np.int32(start), np.int32(size), np.int32(g),
        np.int32(batch or 0), activation=activation, bucket=_bucket(int(size)), rtol=rtol,
        batched=batch is not None))
    for name, (bad, nonfinite, worst, scale) in errors.items():
      if name in ("y", "dx") and not size:
        continue
      assert bad == 0, (f"{what} {name}, group {g}: {bad} elements off by more than rtol={rtol} "
                        f"(atol = rtol * {scale:.4g}), {nonfinite} of them not finite; the "
                        f"largest finite difference {worst:.4g}")


def loss_and_grads(x, weights, gs, go, cot, activation, policy=None):
  """The output and `(dx, dw_gate, dw_up, dw_down)` of `expert_mlp` under a cotangent; with
  `policy` ("everything" or a `jax.checkpoint` policy) the MLP is checkpointed inside the loss,
  so that the gradient recomputes it."""
  def mlp_fn(x, wg, wu, wd):
    return jax_ep.expert_mlp(x, wg, wu, wd, gs, group_offsets=go, activation=activation)
  if policy is not None:
    mlp_fn = jax.checkpoint(mlp_fn, policy=None if policy == "everything" else policy)

  def loss(x, wg, wu, wd):
    y = mlp_fn(x, wg, wu, wd)
    inside = rows_inside_groups(gs, go, x.shape[0])[:, None]
    return jnp.sum(jnp.where(inside, y.astype(jnp.float32) * cot.astype(jnp.float32), 0.0)), y
  argnums = (0, 1, 2, 3) if weights[1] is not None else (0, 1, 3)
  (_, y), grads = jax.value_and_grad(loss, argnums, has_aux=True)(x, *weights)
  if weights[1] is None:
    grads = (grads[0], grads[1], None, grads[2])
  return y, grads


def assert_matches(got, want, inside, what, rtol=3e-2):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  if inside is not None:
    got, want = got[inside], want[inside]
  assert np.isfinite(got).all(), f"{what}: not finite"
  scale = float(np.abs(want).max()) or 1.0
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


# ------------------------------------------------------------------ the activations' math

@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_epilogues_activation_and_derivative_are_jaxs(activation):
  g = jnp.linspace(-12.0, 12.0, 1001, dtype=jnp.float32)
  base = jax.nn.silu if activation in ("swiglu", "silu") else jax.nn.gelu
  np.testing.assert_allclose(mlp.act(g, activation), base(g), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mlp.act_grad(g, activation), jax.vmap(jax.grad(base))(g),
                             rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ the choice

def test_the_choice_on_the_cpu_is_the_unfused_path():
  if choice.on_hopper():
    pytest.skip("this machine has Hopper GPUs")
  fused, why = mlp.fused_mlp_impl(4096, 32, 7168, 2048, jnp.bfloat16, "swiglu")
  assert not fused and "Hopper" in why


def test_the_choice_as_on_hopper(monkeypatch):
  as_on_hopper(monkeypatch)
  assert mlp.fused_mlp_impl(4096, 32, 7168, 2048, jnp.bfloat16, "swiglu")[0]
  fused, why = mlp.fused_mlp_impl(4096, 32, 7168, 2048, jnp.float32, "swiglu")
  assert not fused and "bf16 or f16" in why
  fused, why = mlp.fused_mlp_impl(4096, 32, 7168, 100, jnp.bfloat16, "swiglu")
  assert not fused and "N=100" in why
  with experts.override(fused_mlp=False):
    fused, why = mlp.fused_mlp_impl(4096, 32, 7168, 2048, jnp.bfloat16, "swiglu")
    assert not fused and "fused_mlp=False" in why
  with experts.override(impl="xla"):
    assert not mlp.fused_mlp_impl(4096, 32, 7168, 2048, jnp.bfloat16, "swiglu")[0]


def test_a_fused_kernel_that_does_not_build_falls_back(monkeypatch, caplog):
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  monkeypatch.setattr(choice, "mosaic_compile_error", lambda *args: None)
  monkeypatch.setattr(mlp, "fused_compile_error",
                      lambda *args: "the fused kernels did not compile for it (ValueError)")
  fused, why = mlp.fused_mlp_impl(4096, 32, 7168, 2048, jnp.bfloat16, "swiglu")
  assert not fused and "did not compile" in why


@pytest.mark.parametrize("hidden,ffn", [(7168, 2048), (2048, 768), (4096, 1536), (4096, 14336)])
def test_the_fused_path_has_no_pass_over_the_buffer(monkeypatch, hidden, ffn):
  """Traced as on Hopper at the models' sizes: every value shaped like the buffer's rows comes
  out of a kernel (or is an input), none is float32, and the forward and backward are seven
  kernels: gate-up, down, the fused derivative, the input gradient and three weight
  gradients."""
  as_on_hopper(monkeypatch)
  rows, groups = 1024, 4
  spec = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  args = (spec((rows, hidden), bf16), spec((groups, hidden, ffn), bf16),
          spec((groups, hidden, ffn), bf16), spec((groups, ffn, hidden), bf16),
          spec((groups,), jnp.int32), spec((groups,), jnp.int32), spec((rows, hidden), bf16))

  def fwd_bwd(x, wg, wu, wd, gs, go, cot):
    y, vjp = jax.vjp(lambda *a: jax_ep.expert_mlp(*a, gs, group_offsets=go), x, wg, wu, wd)
    return y, vjp(cot)
  jaxpr = jax.make_jaxpr(fwd_bwd)(*args)
  kernels = {"mpmd_map", "pallas_call"}
  # Calls, and checkpoint_name (`name`: an identity that labels a residual for remat).
  wrappers = {"custom_vjp_call", "custom_vmap_call", "pjit", "closed_call", "custom_jvp_call",
              "name"}
  offenders = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      for v in eqn.outvars:
        shape = getattr(v.aval, "shape", ())
        if len(shape) == 2 and shape[0] == rows and name not in kernels | wrappers:
          offenders.append((name, shape, v.aval.dtype))
        if len(shape) == 2 and shape[0] == rows and v.aval.dtype == jnp.float32:
          offenders.append((name, shape, v.aval.dtype))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        if name not in kernels:
          walk(sub)
  walk(jaxpr.jaxpr)
  assert not offenders, offenders
  assert grouped_matmul_kernels(fwd_bwd, *args) == (7, 0)


@pytest.mark.parametrize("policy,kernels", [
    (None, 8), ("nothing_saveable", 8), ("everything_saveable", 7), ("named", 7)])
def test_checkpoint_policies_recompute_or_keep_the_projections(monkeypatch, policy, kernels):
  """Under jax.checkpoint the backward recomputes the gate-up kernel (eight kernel calls),
  unless the policy saves the fused MLP's residuals: all of them, or the projections by name
  (`mlp.SAVED_NAME`), which are then all it keeps besides the inputs (seven calls)."""
  as_on_hopper(monkeypatch)
  spec = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  rows, groups, hidden, ffn = 1024, 4, 512, 256
  args = (spec((rows, hidden), bf16), spec((groups, hidden, ffn), bf16),
          spec((groups, hidden, ffn), bf16), spec((groups, ffn, hidden), bf16),
          spec((groups,), jnp.int32))

  def loss(x, wg, wu, wd, gs):
    return jnp.sum(jax_ep.expert_mlp(x, wg, wu, wd, gs).astype(jnp.float32))
  policies = jax.checkpoint_policies
  chosen = (policies.save_only_these_names(mlp.SAVED_NAME) if policy == "named"
            else None if policy is None else getattr(policies, policy))
  fn = jax.grad(jax.checkpoint(loss, policy=chosen), (0, 1, 2, 3))
  assert grouped_matmul_kernels(fn, *args) == (kernels, 0)


# ------------------------------------------------------------------ interpreted kernels

@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("alignment", [1, 64])
def test_interpreted_matches_the_unfused_float32_model(interpreted, activation, alignment):
  """Skewed and empty groups, contiguous or at aligned offsets, NaN outside."""
  rng = np.random.default_rng(len(activation) + alignment)
  x, weights, gs, go, cot, inside = make_case(rng, 320, 4, 128, 128, [40, 0, 100, 77],
                                              activation, alignment)
  fused, _ = mlp.fused_mlp_impl(320, 4, 128, 128, jnp.bfloat16, activation)
  assert fused
  y, grads = jax.jit(lambda *a: loss_and_grads(*a, activation))(x, weights, gs, go, cot)
  assert y.dtype == jnp.bfloat16
  check_against_reference(y, grads, x, weights, gs, go, cot, activation)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_interpreted_specialized_kernels(interpreted, activation):
  """The gated projections' and the hidden gradient's warp-specialized kernels (two compute
  warpgroups, each 64 of a CTA tile's 128 columns; the hidden gradient's loaded tiles and
  epilogue slices per warpgroup): the same bits as the one-warpgroup kernels, forward and
  backward, skewed and empty groups, NaN outside."""
  from jax_ep.experts import hopper_fused
  rng = np.random.default_rng(11)
  x, weights, gs, go, cot, inside = make_case(rng, 320, 4, 128, 256, [40, 0, 100, 77],
                                              activation)
  y, grads = jax.jit(lambda *a: loss_and_grads(*a, activation))(x, weights, gs, go, cot)
  tiles = KernelTiles(64, 64, 64, 2, 1, compute_wgs=2)
  launched = []
  specialized = hopper_fused._specialized
  with experts.override(fused_gated_tiles=tiles, fused_hidden_grad_tiles=tiles), \
      pytest.MonkeyPatch.context() as patch:
    patch.setattr(hopper_fused, "_specialized", lambda *a, name, **kw: (
        launched.append(name) or specialized(*a, name=name, **kw)))
    assert mlp.fused_mlp_impl(320, 4, 128, 256, jnp.bfloat16, activation)[0]
    y_ws, grads_ws = jax.jit(lambda *a: loss_and_grads(*a, activation))(x, weights, gs, go, cot)
  assert launched == ["jax_ep_mlp_gate_up", "jax_ep_mlp_hidden_grad"], launched
  np.testing.assert_array_equal(np.asarray(y_ws, np.float32)[inside],
                                np.asarray(y, np.float32)[inside])
  for name, g, want in zip(("dx", "w_gate", "w_up", "w_down"), grads_ws, grads):
    if want is None:
      continue
    g, want = np.asarray(g, np.float32), np.asarray(want, np.float32)
    if name == "dx":
      g, want = g[inside], want[inside]
    np.testing.assert_array_equal(g, want, err_msg=name)
  check_against_reference(y_ws, grads_ws, x, weights, gs, go, cot, activation)


def test_an_override_after_a_trace_takes_effect(interpreted, monkeypatch):
  """A program traced inside `override(...)` after one of the same shapes traced outside it
  runs the overridden kernels (jax keeps a custom_vmap's trace per function: the factories
  are cached per overrides)."""
  from jax_ep.experts import hopper_fused
  launched = []
  launch = hopper_fused.launch
  monkeypatch.setattr(hopper_fused, "launch", lambda body, name, out, tiles, args, **kw: (
      launched.append((name, tiles.stages)) or launch(body, name, out, tiles, args, **kw)))
  rng = np.random.default_rng(3)
  x, weights, gs, go, cot, _ = make_case(rng, 192, 2, 128, 64, [50, 70], "swiglu")

  def stages(**overrides):
    launched.clear()
    with experts.override(**overrides):
      y = jax.jit(lambda *a: loss_and_grads(*a, "swiglu")[0])(x, weights, gs, go, cot)
    return y, [s for name, s in launched if name == "jax_ep_mlp_gate_up"]
  y, first = stages()
  y3, third = stages(fused_gated_tiles=KernelTiles(64, 64, 64, 3, 1))
  assert first == [SMALL.stages] and third == [3], (first, third)
  np.testing.assert_array_equal(np.asarray(y3, np.float32), np.asarray(y, np.float32))


def run_in_shard_map(cases, wrap, activation="swiglu"):
  """`(y, grads)` of each case, stacked on a leading axis, computed inside a one-rank
  shard_map: one call per case ('plain', 'checkpoint'), or one vmap over the cases sharing the
  first case's experts ('vmap') or each with its own ('vmap_weights')."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])

  gated = activation in mlp.GATED

  # Checkpointed inside the loss, so that the gradient recomputes the MLP: everything, or all
  # but the projections kept by name.
  policy = {"checkpoint": "everything", "checkpoint_named":
            jax.checkpoint_policies.save_only_these_names(mlp.SAVED_NAME)}.get(wrap)

  def one(x, wg, wu, wd, gs, go, cot):
    return loss_and_grads(x, (wg, wu if gated else None, wd), gs, go, cot, activation, policy)

  # Shared experts ('vmap', or one case) go in once and unstacked (DeepSeek-V3's are 22.5 GB:
  # a stacked copy would not fit beside them).
  shared = wrap == "vmap" or len(cases) == 1

  def body(x, wg, wu, wd, gs, go, cot):
    if wrap == "vmap":
      return jax.vmap(one, in_axes=(0, None, None, None, 0, 0, 0))(x, wg, wu, wd, gs, go, cot)
    if wrap == "vmap_weights":
      return jax.vmap(one)(x, wg, wu, wd, gs, go, cot)
    outs = [one(x[b], *((wg, wu, wd) if shared else (wg[b], wu[b], wd[b])), gs[b], go[b],
                cot[b]) for b in range(x.shape[0])]
    return jax.tree.map(lambda *v: jnp.stack(v), *outs)

  stack = lambda values: jnp.stack(list(values))  # noqa: E731
  # A plain activation has no up projection: a placeholder goes in its place.
  weights = [(w[0], w[1] if gated else jnp.zeros((1,), w[0].dtype), w[2])
             for w in (c[1] for c in (cases[:1] if shared else cases))]
  weight_args = weights[0] if shared else tuple(stack(w[j] for w in weights) for j in range(3))
  args = (stack(c[0] for c in cases), *weight_args,
          stack(c[2] for c in cases), stack(c[3] for c in cases), stack(c[4] for c in cases))
  spec = P(None)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 7,
                             out_specs=(spec, (spec,) * 4)))
  return fn(*(put(a) for a in args))


@pytest.mark.parametrize("wrap,activation", [
    ("plain", "swiglu"), ("vmap", "swiglu"), ("vmap_weights", "swiglu"), ("vmap", "gelu")])
def test_interpreted_inside_shard_map_under_grad(interpreted, wrap, activation):
  """As the layer calls it: per-rank operands inside shard_map, gradients through the
  custom_vjp, and under vmap (micro-batches sharing the experts, or each its own). One rank:
  see tests/test_grouped_matmul.py for why the interpreter takes one."""
  rng = np.random.default_rng(7)
  cases = [make_case(rng, 192, 2, 128, 64, sizes, activation)
           for sizes in ([50, 70], [0, 130])]
  if wrap == "vmap":  # one set of experts
    cases = [(c[0], cases[0][1], *c[2:]) for c in cases]
  y, grads = run_in_shard_map(cases, wrap, activation)
  for b, (x, weights, gs, go, cot, _) in enumerate(cases):
    check_against_reference(y[b], tuple(None if g is None else g[b] for g in grads), x,
                            weights, gs, go, cot, activation, f"[{b}]")


@pytest.mark.parametrize("compute_wgs", [1, 2])
def test_the_interpreters_race_detector_finds_no_race(monkeypatch, compute_wgs):
  """Forward and backward (seven kernels: the fused gate and up, the down projection, the
  hidden and input gradients, three weight gradients) on three CTAs, many items each, under
  the interpreter's happens-before race detector, one race state per kernel."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, params
  except ImportError:  # the detector's module moved: this jax does not offer it here
    pytest.skip("this jax has no Mosaic GPU race detector at the expected place")
  from jax.experimental.pallas import mosaic_gpu as plgpu
  states = []

  class Recorded(gpu_callbacks.GPURaceDetectionState):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      states.append(self)
  monkeypatch.setattr(gpu_callbacks, "GPURaceDetectionState", Recorded)
  as_on_hopper(monkeypatch)
  rng = np.random.default_rng(7)
  case = make_case(rng, 512, 5, 256, 128, [130, 0, 3, 200, 61], "swiglu")
  tiles = KernelTiles(64, 64, 64, 2, 1, compute_wgs=compute_wgs)
  with plgpu.force_gpu_interpret_mode(params.InterpretGPUParams(detect_races=True)), \
      experts.override(gemm_tiles=tiles, weight_grad_tiles=SMALL, fused_tiles=SMALL,
                       weight_grad_specialized=compute_wgs == 2, kernel_sms=3):
    y, grads = loss_and_grads(*case[:5], "swiglu")
    jax.block_until_ready((y, grads))
  assert len(states) == 7 and not any(state.races_found for state in states), [
      state.races_found for state in states]
  check_against_reference(y, grads, *case[:5], "swiglu")


# NOTES: jax.checkpoint is tested on the GPU only: the interpreter runs the kernels through
# ordered host callbacks, which remat refuses.


# ------------------------------------------------------------------ on the GPU

# The models' shapes at one rank (R=1): experts, hidden, ffn, routed rows.
GPU_SHAPES = {
    "deepseek_v3": (256, 7168, 2048, 4096 * 8),
    "qwen3_30b_a3b": (128, 2048, 768, 4096 * 8),
    "e32_h4096_f1536": (32, 4096, 1536, 4096 * 4),
    "mixtral": (8, 4096, 14336, 4096 * 2),
    "deepseek_v3_ep8_rank": (32, 7168, 2048, 32768),
}


def _skewed_sizes(rng, groups, routed):
  share = rng.dirichlet(np.full(groups, 0.5))
  sizes = np.floor(share * routed).astype(np.int64)
  sizes[np.argmin(sizes)] = 0  # one expert gets nothing
  sizes[0] += routed - sizes.sum()
  return sizes


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
@pytest.mark.parametrize("wrap", ["plain", "vmap", "checkpoint", "checkpoint_named"])
def test_on_the_gpu_at_the_models_shapes(shape, wrap):
  _check_on_the_gpu(shape, wrap, "swiglu")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["geglu", "gelu", "silu"])
def test_on_the_gpu_every_activation(activation):
  """The other activations' epilogues compiled, at one model shape."""
  _check_on_the_gpu("e32_h4096_f1536", "plain", activation)


# The gated projections' and the hidden gradient's one-warpgroup kernels: the default where F
# does not hold the warp-specialized kernels' 128 columns (timed by `bench_expert_mlp.py
# --tiles 128,64,64,4,4`).
ONE_WARPGROUP = {"fused_gated_tiles": KernelTiles(128, 64, 64, 4, 4),
                 "fused_hidden_grad_tiles": KernelTiles(128, 128, 64, 4, 4)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape,wrap,activation", [
    ("deepseek_v3_ep8_rank", "plain", "swiglu"), ("deepseek_v3_ep8_rank", "vmap", "swiglu"),
    ("deepseek_v3_ep8_rank", "checkpoint", "swiglu"), ("mixtral", "plain", "swiglu"),
    ("e32_h4096_f1536", "plain", "gelu")])
def test_on_the_gpu_one_warpgroup_kernels(shape, wrap, activation):
  """The fused MLP's one-warpgroup kernels as the layer calls them (inside shard_map, under
  grad, vmap or jax.checkpoint), against the unfused float32 model."""
  with experts.override(**ONE_WARPGROUP):
    _check_on_the_gpu(shape, wrap, activation)


@pytest.mark.gpu
def test_on_the_gpu_the_same_bits_twice():
  """Every output element has one CTA and one reduction order, so two runs of the same program
  give the same bits: rows inside the groups and every weight gradient (DeepSeek-V3's shape at
  EP=8). A difference is a race in a kernel (an unordered shared-memory or global access),
  which a comparison with the reference may catch only at times."""
  require_hopper()
  groups, hidden, ffn, routed = GPU_SHAPES["deepseek_v3_ep8_rank"]
  rng = np.random.default_rng(1)
  x, weights, gs, go, cot, inside = make_case(rng, 2 * routed, groups, hidden, ffn,
                                              _skewed_sizes(rng, groups, routed), "swiglu")
  step = jax.jit(lambda *a: loss_and_grads(*a, activation="swiglu"))
  first = step(x, weights, gs, go, cot)
  second = step(x, weights, gs, go, cot)
  same = jax.jit(lambda a, b: jnp.all(a.view(jnp.uint16) == b.view(jnp.uint16)))
  rows = jnp.asarray(inside)[:, None]
  for name, a, b in (("y", first[0], second[0]), ("dx", first[1][0], second[1][0])):
    assert bool(same(jnp.where(rows, a, 0), jnp.where(rows, b, 0))), name
  for name, a, b in zip(("dw_gate", "dw_up", "dw_down"), first[1][1:], second[1][1:]):
    assert bool(same(a, b)), name


def _check_on_the_gpu(shape, wrap, activation):
  """The compiled fused kernels at each model's shape (R=1: the routed rows in a buffer twice
  their size, skewed groups, one empty, NaN in the padding), inside shard_map under grad, vmap
  (two micro-batches sharing the experts) or jax.checkpoint (recomputing everything, or
  keeping the projections by name), against the unfused float32 model."""
  require_hopper()
  groups, hidden, ffn, routed = GPU_SHAPES[shape]
  rng = np.random.default_rng(0)
  batch = 2 if wrap == "vmap" else 1
  rows = 2 * routed // batch
  cases = []
  for b in range(batch):
    sizes = _skewed_sizes(rng, groups, routed // batch)
    cases.append(make_case(rng, rows, groups, hidden, ffn, sizes, activation,
                           weights=cases[0][1] if cases else None))
  assert mlp.fused_mlp_impl(rows, groups, hidden, ffn, jnp.bfloat16, activation)[0]
  y, grads = run_in_shard_map(cases, wrap, activation)
  for b, (x, weights, gs, go, cot, _) in enumerate(cases):
    check_against_reference(y, grads, x, weights, gs, go, cot, activation, f"{shape} [{b}]",
                            rtol=5e-2, batch=b)


# ------------------------------------------------------------------ the memory estimate

def test_memory_bytes_counts_the_fused_residuals_on_hopper(monkeypatch):
  """Where the fused kernels run, the experts keep the gate and up projections in bf16 for
  the backward: `jax.vjp`'s residuals of the fused MLP, as `memory_bytes` counts them."""
  from jax_ep import sizing
  kw = dict(num_ranks=8, num_experts=256, num_topk=8, hidden=7168, max_tokens_per_rank=4096,
            ffn=2048, dtype=jnp.bfloat16)
  unfused = jax_ep.memory_bytes(**kw)
  as_on_hopper(monkeypatch)
  fused = jax_ep.memory_bytes(**kw)
  c, f = fused.capacity, 2048
  assert unfused.expert_activation_bytes - fused.expert_activation_bytes == (
      sizing.activation_saved_bytes("swiglu", c, f, jnp.bfloat16) + c * f * 2 - 2 * c * f * 2)
  # What the custom_vjp saves besides the weights: x, the groups, the two projections.
  groups, hidden = 32, 7168
  spec = jax.ShapeDtypeStruct
  args = (spec((c, hidden), jnp.bfloat16), spec((groups, hidden, f), jnp.bfloat16),
          spec((groups, hidden, f), jnp.bfloat16), spec((groups, f, hidden), jnp.bfloat16),
          spec((groups,), jnp.int32), spec((groups,), jnp.int32))
  _, residuals = jax.eval_shape(lambda *a: mlp._fused_fwd(*a, "swiglu"), *args)
  saved = residuals[-1]
  assert sum(a.size * a.dtype.itemsize for a in saved) == mlp.fused_saved_bytes(
      "swiglu", c, f, jnp.bfloat16)


# ------------------------------------------------------------------ the layer

@pytest.mark.parametrize("expert_alignment", [1, 64])
def test_interpreted_layer_matches_the_dense_model(interpreted, expert_alignment):
  """`jax_ep.moe_mlp` on one rank with the fused experts (interpreted), on the dispatch's
  layout (contiguous experts, or each starting at a multiple of 64 with padding between):
  values and every gradient against the dense model."""
  from jax_ep.testing.dense import dense_moe_layer
  num_experts, num_topk, hidden, ffn, tokens = 4, 2, 128, 64, 48
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  group = jax_ep.Group(mesh, "ep", num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                       max_tokens_per_rank=tokens, dtype=jnp.bfloat16, backend="reference",
                       expert_alignment=expert_alignment)
  keys = jax.random.split(jax.random.key(2), 3)
  params = jax_ep.init_moe_params(keys[0], num_experts=num_experts, hidden=hidden, ffn=ffn,
                                  dtype=jnp.bfloat16)
  x = jax.random.normal(keys[1], (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
  cot = jax.random.normal(keys[2], (tokens, hidden), jnp.float32)

  def loss(params, x):
    out = jax_ep.moe_mlp(group, params, x).out
    return jnp.sum(out.astype(jnp.float32) * cot), out

  def dense_loss(params, x):
    out = dense_moe_layer(params, x, num_topk)
    return jnp.sum(out.astype(jnp.float32) * cot), out
  step = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  assert grouped_matmul_kernels(step, params, x) == (7, 0)
  (_, out), grads = jax.jit(step)(params, x)
  (_, want), want_grads = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1),
                                                     has_aux=True))(params, x)
  assert_matches(out, want, None, "out", rtol=5e-2)
  (g_params, g_x), (d_params, d_x) = grads, want_grads
  assert_matches(g_x, d_x, None, "grad x", rtol=5e-2)
  for field, g, d in zip(jax_ep.MoEParams._fields, g_params, d_params):
    if d is None:  # a field this layer has not (no bias, no shared expert)
      assert g is None, field
      continue
    assert_matches(g, d, None, f"grad {field}", rtol=5e-2)
