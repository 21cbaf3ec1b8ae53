"""jax_ep.grouped_matmul against a dense oracle: values, gradients, vmap, both implementations.

The Mosaic GPU path runs on Hopper GPUs only; on the CPU its wrapper (which implementation a
shape gets, the zeroed rows past the groups, the dtype of the result, the layouts handed to the
kernels, the weight gradient through the transposed kernel) runs against emulated kernels that
keep the real ones' contracts: operands of one dtype, results in that dtype, K and N multiples
of the tiles, and nothing written past the groups (filled with NaN here).
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_ep
from ep_test_base import count_primitive
from jax_ep import gmm as gmm_module

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def oracle(x, w, group_sizes, transpose_w=False):
  """Row r of group g is x[r] @ w[g] (float64); rows past the groups are zero."""
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  if transpose_w:
    w = np.swapaxes(w, 1, 2)
  out = np.zeros((x.shape[0], w.shape[2]))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    out[start:start + size] = x[start:start + size] @ w[g]
    start += size
  return out


def inputs(rng, rows, groups, k, n, sizes=None, dtype=jnp.float32, transpose_w=False):
  if sizes is None:
    cuts = np.sort(rng.integers(0, rows + 1, groups - 1))
    bounds = np.concatenate([[0], cuts, [rng.integers(cuts[-1] if groups > 1 else 0, rows + 1)]])
    sizes = np.diff(bounds)
  x = rng.standard_normal((rows, k)).astype(np.float32)
  shape = (groups, n, k) if transpose_w else (groups, k, n)
  w = (rng.standard_normal(shape) / np.sqrt(k)).astype(np.float32)
  return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes, jnp.int32)


SHAPES = [  # rows, groups, K, N, group sizes (None: random, some rows past the groups)
    (37, 3, 19, 40, None), (64, 1, 8, 8, [64]), (50, 4, 16, 24, [0, 20, 0, 25]),
    (12, 5, 7, 9, [0, 0, 0, 0, 0])]


@pytest.mark.parametrize("rows,groups,k,n,sizes", SHAPES)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_matches_the_dense_oracle(rows, groups, k, n, sizes, transpose_w):
  x, w, gs = inputs(np.random.default_rng(rows), rows, groups, k, n, sizes,
                    transpose_w=transpose_w)
  got = jax.jit(lambda x, w, gs: jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w))(
      x, w, gs)
  np.testing.assert_allclose(got, oracle(x, w, gs, transpose_w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,groups,k,n,sizes", SHAPES[:3])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_gradients_match_lax_ragged_dot(rows, groups, k, n, sizes, transpose_w):
  x, w, gs = inputs(np.random.default_rng(rows + 1), rows, groups, k, n, sizes,
                    transpose_w=transpose_w)
  cot = jnp.asarray(np.random.default_rng(2).standard_normal((rows, n)), jnp.float32)

  def ours(x, w):
    return jnp.sum(jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w) * cot)

  def theirs(x, w):
    w_kn = jnp.swapaxes(w, 1, 2) if transpose_w else w
    y = jax.lax.ragged_dot(x, w_kn, gs)
    return jnp.sum(jnp.where(jnp.arange(rows)[:, None] < jnp.sum(gs), y, 0.0) * cot)

  for got, want in zip(jax.jit(jax.grad(ours, (0, 1)))(x, w), jax.grad(theirs, (0, 1))(x, w)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_preferred_element_type():
  x, w, gs = inputs(np.random.default_rng(0), 32, 2, 16, 8, [10, 12], dtype=jnp.bfloat16)
  out = jax_ep.grouped_matmul(x, w, gs, preferred_element_type=jnp.float32)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, oracle(x, w, gs), rtol=2e-2, atol=2e-2)
  assert jax_ep.grouped_matmul(x, w, gs).dtype == jnp.bfloat16


def _batched(rng, batch, rows, groups, k, n):
  xs, ws, gss = zip(*(inputs(rng, rows, groups, k, n) for _ in range(batch)))
  return jnp.stack(xs), jnp.stack(ws), jnp.stack(gss)


@pytest.mark.parametrize("batched", ["x_and_sizes", "weights_too", "x_only"])
def test_vmap_folds_the_batch_into_one_call(batched):
  rng = np.random.default_rng(7)
  xs, ws, gss = _batched(rng, 3, 29, 4, 16, 24)
  if batched == "x_only":
    gss = gss[0]
  in_axes = {"x_and_sizes": (0, None, 0), "weights_too": (0, 0, 0), "x_only": (0, None, None)}
  args = (xs, ws[0] if in_axes[batched][1] is None else ws, gss)
  fn = jax.vmap(jax_ep.grouped_matmul, in_axes=in_axes[batched])
  got = jax.jit(fn)(*args)
  for b in range(3):
    w = ws[0] if in_axes[batched][1] is None else ws[b]
    gs = gss if batched == "x_only" else gss[b]
    np.testing.assert_allclose(got[b], oracle(xs[b], w, gs), rtol=1e-5, atol=1e-5)
  # One grouped product in the program, not one per batch element.
  assert count_primitive(jax.make_jaxpr(fn)(*args).jaxpr, "ragged_dot_general") == 1


def test_vmap_with_no_rows():
  x, w, gs = jnp.zeros((3, 0, 8)), jnp.ones((2, 8, 4)), jnp.zeros((3, 2), jnp.int32)
  y = jax.vmap(jax_ep.grouped_matmul, in_axes=(0, None, 0))(x, w, gs)
  assert y.shape == (3, 0, 4)
  dw = jax.grad(lambda w: jnp.sum(jax.vmap(jax_ep.grouped_matmul, in_axes=(0, None, 0))(
      x, w, gs)))(w)
  np.testing.assert_array_equal(dw, 0.0)


def test_gradients_under_vmap_with_shared_weights():
  rng = np.random.default_rng(8)
  xs, ws, gss = _batched(rng, 3, 21, 3, 8, 16)
  w = ws[0]
  cots = jnp.asarray(rng.standard_normal((3, 21, 16)), jnp.float32)

  def loss(x, w, gs, cot):
    return jnp.sum(jax_ep.grouped_matmul(x, w, gs) * cot)

  def total(w):
    return jnp.sum(jax.vmap(loss, in_axes=(0, None, 0, 0))(xs, w, gss, cots))
  got_w = jax.jit(jax.grad(total))(w)
  got_x = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None, 0, 0)))(xs, w, gss, cots)
  want_w = sum(jax.grad(loss, 1)(xs[b], w, gss[b], cots[b]) for b in range(3))
  np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-5)
  for b in range(3):
    np.testing.assert_allclose(got_x[b], jax.grad(loss)(xs[b], w, gss[b], cots[b]),
                               rtol=1e-5, atol=1e-5)


def test_impl_says_why_on_the_cpu():
  if gmm_module._on_hopper():
    pytest.skip("this machine has Hopper GPUs")
  name, why = jax_ep.grouped_matmul_impl(4096, 32, 7168, 2048, jnp.bfloat16)
  assert name == "xla" and "Hopper" in why
  with pytest.raises(ValueError, match="impl='mosaic' cannot run"):
    jax_ep.grouped_matmul_impl(4096, 32, 7168, 2048, jnp.bfloat16, impl="mosaic")


def test_tile_rule():
  assert gmm_module.tile_config(32768, 256, 7168, 2048) == gmm_module.TileConfig(
      128, 128, 64, 4, 8)
  assert gmm_module.tile_config(100, 8, 64, 192).block_n == 64  # 192 % 128 != 0
  assert gmm_module.tile_config(100, 8, 100, 128) is None  # K % 64 != 0
  assert gmm_module.tile_config(100, 8, 64, 100) is None


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(x=jnp.zeros((4, 3)), w=jnp.zeros((2, 4, 5))), ValueError, "w must be \\[G, K, N\\]"),
    (dict(w=jnp.zeros((2, 8, 5))), ValueError, "group_sizes must have shape \\[G\\] = \\(2,\\)"),
    (dict(w=jnp.zeros((3, 8, 5), jnp.bfloat16)), TypeError, "w must have x's dtype"),
    (dict(group_sizes=jnp.zeros((3,))), TypeError, "group_sizes must be int32"),
    (dict(x=jnp.zeros((4,))), ValueError, "x must have 2 dimensions"),
])
def test_bad_arguments_are_named(kwargs, error, message):
  args = dict(x=jnp.zeros((4, 8)), w=jnp.zeros((3, 8, 5)), group_sizes=jnp.zeros((3,), jnp.int32))
  args.update(kwargs)
  with pytest.raises(error, match=message):
    jax_ep.grouped_matmul(args["x"], args["w"], args["group_sizes"])


# ------------------------------------------------------------------ the Mosaic path, emulated

@pytest.fixture
def emulated_mosaic(monkeypatch):
  """Hopper and its kernels emulated with their contracts (see the module docstring)."""
  calls = []

  def ragged_dot(x, w, group_sizes, transpose_w, config):
    assert x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)
    k = x.shape[1]
    n = w.shape[1] if transpose_w else w.shape[2]
    assert k % config.block_k == 0 and n % config.block_n == 0, (k, n, config)
    calls.append("ragged_dot")
    w_kn = jnp.swapaxes(w, 1, 2) if transpose_w else w
    y = jax.lax.ragged_dot(x, w_kn, group_sizes, preferred_element_type=jnp.float32)
    used = jnp.arange(x.shape[0])[:, None] < jnp.sum(group_sizes)
    return jnp.where(used, y, jnp.nan).astype(x.dtype)

  def transposed(x, dy, group_sizes, config):
    assert x.dtype == dy.dtype
    assert x.shape[1] % config.block_m == 0 and dy.shape[1] % config.block_n == 0
    calls.append("transposed_ragged_dot")
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(x, dy, group_sizes, numbers,
                                      preferred_element_type=jnp.float32).astype(x.dtype)

  monkeypatch.setattr(gmm_module, "_on_hopper", lambda: True)
  monkeypatch.setattr(gmm_module, "_mosaic_ragged_dot", ragged_dot)
  monkeypatch.setattr(gmm_module, "_mosaic_transposed_ragged_dot", transposed)
  gmm_module._mosaic_compile_error.cache_clear()
  yield calls
  gmm_module._mosaic_compile_error.cache_clear()


@pytest.mark.parametrize("transpose_w", [False, True])
def test_mosaic_path_values_and_gradients(emulated_mosaic, transpose_w):
  rows, groups, k, n = 300, 4, 128, 192
  x, w, gs = inputs(np.random.default_rng(3), rows, groups, k, n, [40, 0, 100, 90],
                    dtype=jnp.bfloat16, transpose_w=transpose_w)
  assert jax_ep.grouped_matmul_impl(rows, groups, k, n, jnp.bfloat16)[0] == "mosaic"
  y = jax.jit(lambda x, w: jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w))(x, w)
  assert y.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y, np.float32)).all()
  np.testing.assert_allclose(np.asarray(y, np.float32), oracle(x, w, gs, transpose_w),
                             rtol=2e-2, atol=3e-2)
  cot = jnp.asarray(np.random.default_rng(4).standard_normal((rows, n)), jnp.bfloat16)

  def loss(x, w):
    out = jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w, impl="mosaic")
    return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))
  dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
  assert "transposed_ragged_dot" in emulated_mosaic
  xf, wf, cf = (np.asarray(v, np.float64) for v in (x, w, cot))
  want_dx = oracle(cf, np.swapaxes(wf, 1, 2) if not transpose_w else wf, gs, False)
  ends = np.cumsum(np.asarray(gs))
  want_dw = np.stack([xf[e - s:e].T @ cf[e - s:e] for s, e in zip(np.asarray(gs), ends)])
  if transpose_w:
    want_dw = np.swapaxes(want_dw, 1, 2)
  np.testing.assert_allclose(np.asarray(dx, np.float32), want_dx, rtol=3e-2, atol=6e-2)
  np.testing.assert_allclose(np.asarray(dw, np.float32), want_dw, rtol=3e-2, atol=3e-1)


def test_mosaic_path_falls_back_where_the_tiles_do_not_divide(emulated_mosaic):
  x, w, gs = inputs(np.random.default_rng(5), 40, 2, 100, 64, [10, 20], dtype=jnp.bfloat16)
  name, why = jax_ep.grouped_matmul_impl(40, 2, 100, 64, jnp.bfloat16)
  assert name == "xla" and "K=100" in why
  np.testing.assert_allclose(np.asarray(jax_ep.grouped_matmul(x, w, gs), np.float32),
                             oracle(x, w, gs), rtol=2e-2, atol=3e-2)
  assert emulated_mosaic == []
  name, why = jax_ep.grouped_matmul_impl(40, 2, 128, 128, jnp.float32)
  assert name == "xla" and "bf16 or f16" in why


def test_mosaic_path_falls_back_where_the_kernel_does_not_compile(emulated_mosaic, monkeypatch):
  def does_not_build(*args):
    raise ValueError("Mosaic GPU kernel exceeds available shared memory")
  monkeypatch.setattr(gmm_module, "_mosaic_ragged_dot", does_not_build)
  name, why = jax_ep.grouped_matmul_impl(256, 4, 128, 256, jnp.bfloat16)
  assert name == "xla" and "did not compile for it (ValueError: Mosaic GPU kernel exceeds" in why
  x, w, gs = inputs(np.random.default_rng(9), 256, 4, 128, 256, [64] * 4, dtype=jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(jax_ep.grouped_matmul(x, w, gs), np.float32),
                             oracle(x, w, gs), rtol=2e-2, atol=3e-2)


def test_mosaic_path_under_vmap(emulated_mosaic):
  rng = np.random.default_rng(6)
  xs, ws, gss = zip(*(inputs(rng, 70, 3, 64, 128, dtype=jnp.bfloat16) for _ in range(2)))
  xs, gss = jnp.stack(xs), jnp.stack(gss)
  got = jax.jit(jax.vmap(jax_ep.grouped_matmul, in_axes=(0, None, 0)))(xs, ws[0], gss)
  for b in range(2):
    np.testing.assert_allclose(np.asarray(got[b], np.float32), oracle(xs[b], ws[0], gss[b]),
                               rtol=2e-2, atol=3e-2)


# ------------------------------------------------------------------ the Mosaic path, on a GPU

GPU_SHAPES = [  # rows, groups, K, N, sizes: skewed, empty groups, rows past the groups
    (1024, 8, 256, 512, [1000, 0, 0, 24, 0, 0, 0, 0]),
    (777, 5, 128, 192, [0, 300, 0, 200, 150]),
    (4096, 32, 512, 256, None),
    (300, 3, 100, 128, [100, 100, 50]),    # K not a multiple of the tile: lax.ragged_dot
    (300, 3, 128, 100, [0, 200, 50]),      # N not a multiple of the tile: lax.ragged_dot
]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,groups,k,n,sizes", GPU_SHAPES)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_on_the_gpu_against_lax_ragged_dot(rows, groups, k, n, sizes, transpose_w):
  if not gmm_module._on_hopper():
    pytest.skip("the Mosaic GPU kernel runs on Hopper GPUs")
  x, w, gs = inputs(np.random.default_rng(rows), rows, groups, k, n, sizes,
                    dtype=jnp.bfloat16, transpose_w=transpose_w)
  cot = jnp.asarray(np.random.default_rng(1).standard_normal((rows, n)), jnp.bfloat16)

  def loss(impl):
    def f(x, w):
      y = jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w, impl=impl)
      return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32)), y
    return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))
  (_, y), (dx, dw) = loss("auto")(x, w)
  (_, y_ref), (dx_ref, dw_ref) = loss("xla")(x, w)
  scale = lambda a: float(np.abs(np.asarray(a, np.float32)).max()) + 1e-6
  for got, want, what in ((y, y_ref, "y"), (dx, dx_ref, "dx"), (dw, dw_ref, "dw")):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), what
    assert np.abs(got - want).max() <= 2e-2 * scale(want), what
  used = int(np.asarray(gs).sum())
  np.testing.assert_array_equal(np.asarray(y, np.float32)[used:], 0.0)
