"""jax_ep.grouped_matmul against a dense oracle: values, gradients, vmap, both implementations.

Rows past `sum(group_sizes)` are unspecified in the result, and no result or gradient may depend
on what the input holds there: the tests fill them with NaN and compare the rows inside the
groups.

jax_ep's Mosaic GPU kernels run on Hopper GPUs. On the CPU the same kernels run in Pallas's
Mosaic GPU interpreter (`plgpu.force_gpu_interpret_mode`), traced exactly as on the GPU, inside
`shard_map`, under `grad`, `vmap` and `jax.checkpoint`: what the interpreter checks is the
logic around the kernels (the work list, the stores that stop at the groups, the selects that
keep the rows past the groups out of the weight gradient, the result's typing inside
`shard_map`); the `gpu`-marked tests run the compiled kernels.
"""

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_ep
from ep_test_base import count_primitive, grouped_matmul_kernels, require_hopper
from jax_ep import experts
from jax_ep.experts import builds, choice, configs, layout, mlp
from jax_ep.experts.configs import KernelTiles

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def oracle(x, w, group_sizes, transpose_w=False):
  """Row r of group g is x[r] @ w[g] (float64); rows past the groups are zero (compare them
  with `used_rows` only)."""
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


def used_rows(a, group_sizes):
  """The rows of `a` inside the groups (float64)."""
  return np.asarray(a, np.float64)[:int(np.asarray(group_sizes).sum())]


def poison_tail(a, group_sizes):
  """`a` with NaN in every row past the groups (what a dispatch may leave there)."""
  return a.at[int(np.asarray(group_sizes).sum()):].set(jnp.nan)


def weight_grad_oracle(x, dy, starts, sizes):
  """`[G, K, N]` float32: each group's `x[rows]^T dy[rows]` from its first row and size."""
  return np.stack([np.asarray(x[s:s + n], np.float32).T @ np.asarray(dy[s:s + n], np.float32)
                   for s, n in zip(np.asarray(starts), np.asarray(sizes))])


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


def assert_rows_close(got, want, group_sizes, rtol, atol):
  got, want = used_rows(got, group_sizes), used_rows(want, group_sizes)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("rows,groups,k,n,sizes", SHAPES)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_matches_the_dense_oracle(rows, groups, k, n, sizes, transpose_w):
  x, w, gs = inputs(np.random.default_rng(rows), rows, groups, k, n, sizes,
                    transpose_w=transpose_w)
  got = jax.jit(lambda x, w, gs: jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w))(
      poison_tail(x, gs), w, gs)
  assert_rows_close(got, oracle(x, w, gs, transpose_w), gs, 1e-5, 1e-5)


def _cotangent(rng, rows, n, gs, dtype=jnp.float32):
  """A cotangent with NaN past the groups (the backward of combine leaves those rows
  unspecified)."""
  return poison_tail(jnp.asarray(rng.standard_normal((rows, n)), dtype), gs)


def _masked_loss(y, cot, gs):
  """sum(y * cot) over the rows inside the groups; the NaN past them stays out of the forward
  and their cotangent is NaN: gradients must not depend on those rows."""
  rows = y.shape[0]
  prod = y.astype(jnp.float32) * jnp.nan_to_num(cot.astype(jnp.float32))
  return jnp.sum(jnp.where(jnp.arange(rows)[:, None] < jnp.sum(gs), prod, 0.0))


def _dense_grads(x, w, gs, cot, transpose_w):
  """float64 gradients of sum(y * cot) over the groups' rows: dx (rows inside the groups) and
  dw."""
  xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
  cf = np.nan_to_num(np.asarray(cot, np.float64))
  w_kn = np.swapaxes(wf, 1, 2) if transpose_w else wf
  sizes = np.asarray(gs)
  ends = np.cumsum(sizes)
  dx = np.zeros_like(xf)
  dw = np.zeros_like(w_kn)
  for g, (size, end) in enumerate(zip(sizes, ends)):
    rows = slice(end - size, end)
    dx[rows] = cf[rows] @ w_kn[g].T
    dw[g] = xf[rows].T @ cf[rows]
  return dx, (np.swapaxes(dw, 1, 2) if transpose_w else dw)


@pytest.mark.parametrize("rows,groups,k,n,sizes", SHAPES[:3])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_gradients_match_the_dense_oracle(rows, groups, k, n, sizes, transpose_w):
  rng = np.random.default_rng(rows + 1)
  x, w, gs = inputs(rng, rows, groups, k, n, sizes, transpose_w=transpose_w)
  cot = _cotangent(rng, rows, n, gs)

  def loss(x, w):
    return _masked_loss(jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w), cot, gs)

  dx, dw = jax.jit(jax.grad(loss, (0, 1)))(poison_tail(x, gs), w)
  want_dx, want_dw = _dense_grads(x, w, gs, cot, transpose_w)
  assert_rows_close(dx, want_dx, gs, 1e-5, 1e-5)
  assert np.isfinite(np.asarray(dw)).all()
  np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)


def test_preferred_element_type():
  x, w, gs = inputs(np.random.default_rng(0), 32, 2, 16, 8, [10, 12], dtype=jnp.bfloat16)
  out = jax_ep.grouped_matmul(x, w, gs, preferred_element_type=jnp.float32)
  assert out.dtype == jnp.float32
  assert_rows_close(out, oracle(x, w, gs), gs, 2e-2, 2e-2)
  assert jax_ep.grouped_matmul(x, w, gs).dtype == jnp.bfloat16


def _batched(rng, batch, rows, groups, k, n, dtype=jnp.float32):
  xs, ws, gss = zip(*(inputs(rng, rows, groups, k, n, dtype=dtype) for _ in range(batch)))
  xs = [poison_tail(x, gs) for x, gs in zip(xs, gss)]
  return jnp.stack(xs), jnp.stack(ws), jnp.stack(gss)


@pytest.mark.parametrize("batched", ["x_and_sizes", "weights_too", "x_only"])
def test_vmap_folds_the_batch_into_one_call(batched):
  rng = np.random.default_rng(7)
  xs, ws, gss = _batched(rng, 3, 29, 4, 16, 24)
  if batched == "x_only":
    gss = gss[0]
    xs = jnp.nan_to_num(xs)  # one set of groups for every element: no element has NaN inside
  in_axes = {"x_and_sizes": (0, None, 0), "weights_too": (0, 0, 0), "x_only": (0, None, None)}
  args = (xs, ws[0] if in_axes[batched][1] is None else ws, gss)
  fn = jax.vmap(jax_ep.grouped_matmul, in_axes=in_axes[batched])
  got = jax.jit(fn)(*args)
  for b in range(3):
    w = ws[0] if in_axes[batched][1] is None else ws[b]
    gs = gss if batched == "x_only" else gss[b]
    assert_rows_close(got[b], oracle(xs[b], w, gs), gs, 1e-5, 1e-5)
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
  cots = jnp.stack([_cotangent(rng, 21, 16, gs) for gs in gss])

  def loss(x, w, gs, cot):
    return _masked_loss(jax_ep.grouped_matmul(x, w, gs), cot, gs)

  def total(w):
    return jnp.sum(jax.vmap(loss, in_axes=(0, None, 0, 0))(xs, w, gss, cots))
  got_w = jax.jit(jax.grad(total))(w)
  got_x = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None, 0, 0)))(xs, w, gss, cots)
  want = [_dense_grads(jnp.nan_to_num(xs[b]), w, gss[b], cots[b], False) for b in range(3)]
  np.testing.assert_allclose(got_w, sum(dw for _, dw in want), rtol=1e-5, atol=1e-5)
  for b in range(3):
    assert_rows_close(got_x[b], want[b][0], gss[b], 1e-5, 1e-5)


def test_impl_says_why_on_the_cpu():
  if choice.on_hopper():
    pytest.skip("this machine has Hopper GPUs")
  name, why = jax_ep.grouped_matmul_impl(4096, 32, 7168, 2048, jnp.bfloat16)
  assert name == "xla" and "Hopper" in why
  with pytest.raises(ValueError, match="impl='mosaic' cannot run"):
    jax_ep.grouped_matmul_impl(4096, 32, 7168, 2048, jnp.bfloat16, impl="mosaic")


def test_tile_rule():
  assert configs.tile_config(32768, 256, 7168, 2048) == configs.TILE_TABLES[
      ("sm90", np.dtype(jnp.bfloat16))][(256, 7168, 2048)]
  assert configs.tile_config(100, 8, 64, 512) == KernelTiles(
      128, 128, 64, 3, 1, compute_wgs=2)
  assert configs.tile_config(100, 8, 64, 384) == KernelTiles(
      128, 64, 64, 6, 4, compute_wgs=2)
  assert configs.tile_config(100, 8, 64, 192) == KernelTiles(
      128, 64, 64, 4, 4)  # 192 % 128 != 0: one warpgroup
  assert configs.tile_config(100, 8, 100, 128) is None  # K % 64 != 0
  # Few groups: one CTA per SM, two compute warpgroups where K holds their 256 rows; many
  # (each a few hundred rows): two CTAs per SM at 3 stages.
  assert configs.weight_grad_tiles(7168, 2048, 32) == KernelTiles(
      128, 128, 64, 3, 4, compute_wgs=2)
  assert configs.weight_grad_tiles(7168, 2048, 256) == KernelTiles(
      128, 128, 64, 3, 4, ctas_per_sm=2)
  assert configs.weight_grad_tiles(384, 2048, 32) == KernelTiles(128, 128, 64, 4, 4)
  assert configs.weight_grad_tiles(256, 192, 8).block_n == 64
  assert configs.weight_grad_tiles(64, 128, 8) is None  # K % 128 != 0
  assert configs.tile_config(100, 8, 64, 100) is None


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


# ------------------------------------------------------------------ the work list

@pytest.mark.parametrize("sizes,rows", [
    ([40, 0, 100, 90], 300), ([0, 0, 0], 64), ([300, 0, 0], 300), ([0, 0, 17], 1000),
    ([128, 128, 1], 512), ([1] * 9, 9), ([5, 0, 250, 3, 0, 7], 4096)])
def test_work_list_covers_each_groups_rows_once(sizes, rows):
  block_m = 128
  tile, group, first, count, num = (np.asarray(a) for a in layout.row_tiles(
      jnp.asarray(sizes, jnp.int32), rows, block_m))
  num = int(num[0])
  assert tile.shape == (-(-rows // block_m) + len(sizes) - 1,)
  covered = []
  for i in range(num):
    assert count[i] > 0 and 0 <= first[i] and first[i] + count[i] <= block_m
    covered += [(group[i], r) for r in range(tile[i] * block_m + first[i],
                                             tile[i] * block_m + first[i] + count[i])]
  ends = np.cumsum(sizes)
  want = [(g, r) for g, (s, e) in enumerate(zip(ends - sizes, ends)) for r in range(s, e)]
  assert covered == want  # every row of every group once, in row order, nothing past them
  assert (count[num:] == 0).all()


# ------------------------------------------------------------------ groups at offsets

def aligned_layout(sizes, alignment, rows):
  """`(offsets, inside)`: each group's rows start at a multiple of `alignment` (the layout
  `expert_alignment` gives a dispatch) and the `[rows]` bool of the rows inside a group."""
  offsets, start = [], 0
  for size in sizes:
    offsets.append(start)
    start += -(-size // alignment) * alignment
  inside = np.zeros(rows, bool)
  for off, size in zip(offsets, sizes):
    inside[off:off + size] = True
  assert offsets[-1] + sizes[-1] <= rows
  return jnp.asarray(offsets, jnp.int32), inside


def _dense_at_offsets(x, w, sizes, offsets, cot, transpose_w):
  """float64 y, dx (rows inside the groups; 0 elsewhere) and dw of sum(y * cot) over the
  groups' rows, groups at `offsets`."""
  xf = np.nan_to_num(np.asarray(x, np.float64))
  wf = np.asarray(w, np.float64)
  cf = np.nan_to_num(np.asarray(cot, np.float64))
  w_kn = np.swapaxes(wf, 1, 2) if transpose_w else wf
  y, dx = np.zeros((xf.shape[0], w_kn.shape[2])), np.zeros_like(xf)
  dw = np.zeros_like(w_kn)
  for g, (off, size) in enumerate(zip(np.asarray(offsets), np.asarray(sizes))):
    r = slice(off, off + size)
    y[r] = xf[r] @ w_kn[g]
    dx[r] = cf[r] @ w_kn[g].T
    dw[g] = xf[r].T @ cf[r]
  return y, dx, (np.swapaxes(dw, 1, 2) if transpose_w else dw)


def _check_at_offsets(rng, rows, k, n, sizes, alignment, transpose_w, dtype, tol, impl="auto"):
  """Values and both gradients with the groups at aligned offsets; NaN in every row outside
  the groups (the gaps and the tail) of the input and of the output's cotangent. Each result
  is within `tol` times its largest magnitude of the float64 oracle."""
  groups = len(sizes)
  x, w, gs = inputs(rng, rows, groups, k, n, sizes, dtype=dtype, transpose_w=transpose_w)
  offsets, inside = aligned_layout(sizes, alignment, rows)
  mask = jnp.asarray(inside)[:, None]
  x = jnp.where(mask, x, jnp.nan)
  cot = jnp.where(mask, jnp.asarray(rng.standard_normal((rows, n)), dtype), jnp.nan)

  def loss(x, w):
    y = jax_ep.grouped_matmul(x, w, gs, group_offsets=offsets, transpose_w=transpose_w,
                              impl=impl)
    prod = y.astype(jnp.float32) * jnp.nan_to_num(cot.astype(jnp.float32))
    return jnp.sum(jnp.where(mask, prod, 0.0)), y
  (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)
  want_y, want_dx, want_dw = _dense_at_offsets(x, w, gs, offsets, cot, transpose_w)
  for name, got, want in (("y", np.asarray(y, np.float64)[inside], want_y[inside]),
                          ("dx", np.asarray(dx, np.float64)[inside], want_dx[inside]),
                          ("dw", np.asarray(dw, np.float64), want_dw)):
    assert np.isfinite(got).all(), name
    scale = float(np.abs(want).max()) if want.size else 0.0
    assert (float(np.abs(got - want).max()) if got.size else 0.0) <= tol * scale + 1e-6, name


@pytest.mark.parametrize("sizes,rows,alignment", [
    ([40, 0, 100, 90], 300, 8), ([3, 0, 0, 17], 96, 16), ([0, 0], 10, 4), ([33], 64, 32)])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_groups_at_offsets_match_the_dense_oracle(sizes, rows, alignment, transpose_w):
  _check_at_offsets(np.random.default_rng(rows), rows, 16, 24, sizes, alignment, transpose_w,
                    jnp.float32, 1e-5)


def test_work_list_skips_the_gaps_between_groups():
  sizes, rows, block_m = [40, 0, 100, 90, 0, 1], 1024, 128
  offsets, inside = aligned_layout(sizes, 128, rows)
  tile, group, first, count, num = (np.asarray(a) for a in layout.row_tiles(
      jnp.asarray(sizes, jnp.int32), rows, block_m, offsets))
  covered = set()
  for i in range(int(num[0])):
    base = tile[i] * block_m + first[i]
    assert inside[base:base + count[i]].all()
    covered |= {(group[i], r) for r in range(base, base + count[i])}
  want = {(g, r) for g, (o, s) in enumerate(zip(np.asarray(offsets), sizes))
          for r in range(o, o + s)}
  assert covered == want
  assert int(num[0]) == 4  # one tile per non-empty group: alignment to the row tile


@pytest.mark.parametrize("w_batched", [False, True])
def test_vmap_with_groups_at_offsets(w_batched):
  rng = np.random.default_rng(21)
  batch, rows, groups, k, n = 3, 40, 3, 8, 16
  all_sizes = [[5, 0, 9], [0, 12, 3], [7, 7, 7]]
  layouts = [aligned_layout(s, 8, rows) for s in all_sizes]
  xs = jnp.stack([jnp.where(jnp.asarray(inside)[:, None],
                            jnp.asarray(rng.standard_normal((rows, k)), jnp.float32), jnp.nan)
                  for _, inside in layouts])
  ws = jnp.asarray(rng.standard_normal((batch if w_batched else 1, groups, k, n)), jnp.float32)
  w_arg = ws if w_batched else ws[0]
  gss = jnp.asarray(all_sizes, jnp.int32)
  offs = jnp.stack([o for o, _ in layouts])
  cots = jnp.asarray(rng.standard_normal((batch, rows, n)), jnp.float32)
  masks = jnp.stack([jnp.asarray(inside) for _, inside in layouts])[..., None]

  def loss(x, w, gs, off, cot, mask):
    y = jax_ep.grouped_matmul(x, w, gs, group_offsets=off)
    return jnp.sum(jnp.where(mask, y * cot, 0.0)), y
  in_axes = (0, 0 if w_batched else None, 0, 0, 0, 0)
  grad_fn = jax.vmap(jax.value_and_grad(loss, (0, 1), has_aux=True), in_axes=in_axes)
  (_, y), (dx, dw) = jax.jit(grad_fn)(xs, w_arg, gss, offs, cots, masks)
  for b in range(batch):
    w = ws[b] if w_batched else ws[0]
    want_y, want_dx, want_dw = _dense_at_offsets(xs[b], w, gss[b], offs[b], cots[b], False)
    inside = layouts[b][1]
    np.testing.assert_allclose(np.asarray(y[b])[inside], want_y[inside], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx[b])[inside], want_dx[inside], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(dw[b], want_dw, rtol=1e-5, atol=1e-5)


def test_bad_group_offsets_are_named():
  x, w, gs = jnp.zeros((4, 8)), jnp.zeros((3, 8, 5)), jnp.zeros((3,), jnp.int32)
  with pytest.raises(ValueError, match="group_offsets must have shape \\[G\\] = \\(3,\\)"):
    jax_ep.grouped_matmul(x, w, gs, group_offsets=jnp.zeros((2,), jnp.int32))
  with pytest.raises(TypeError, match="group_offsets must be int32"):
    jax_ep.grouped_matmul(x, w, gs, group_offsets=jnp.zeros((3,)))


# ------------------------------------------------------------------ the kernels, interpreted

def as_on_hopper(monkeypatch):
  """The choice of kernel as on a Hopper GPU, every shape's kernel taken to build."""
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  monkeypatch.setattr(choice, "mosaic_compile_error", lambda *args: None)


SMALL_TILES = KernelTiles(64, 64, 64, 2, 1)  # tiles the small test shapes divide


@pytest.fixture
def interpreted_kernels(monkeypatch):
  """jax_ep's Mosaic GPU kernels on the CPU, in Pallas's Mosaic GPU interpreter."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  as_on_hopper(monkeypatch)
  with plgpu.force_gpu_interpret_mode(), experts.override(gemm_tiles=SMALL_TILES,
                                                          weight_grad_tiles=SMALL_TILES):
    yield


def test_a_staged_row_under_128_bytes_does_not_build():
  """An item's rows are stored from any row of the staged tile, and a TMA copy's shared-memory
  address must be 128-byte aligned: tiles of 32 bf16 columns (64-byte rows) are refused when
  the kernel is built, not left to fault on the GPU."""
  from jax_ep.experts import hopper
  operands = (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
              jax.ShapeDtypeStruct((2, 128, 64), jnp.bfloat16),
              jax.ShapeDtypeStruct((2,), jnp.int32))
  kernel = lambda x, w, gs: hopper.grouped_matmul_kernel(  # noqa: E731
      x, w, gs, transpose_w=False, tiles=KernelTiles(64, 32, 64, 2, 1))
  with pytest.raises(ValueError, match="64 bytes; stored from any row it must be a multiple"):
    jax.jit(kernel).trace(*operands).lower(lowering_platforms=("cuda",))


KERNEL_CASES = [  # rows, groups, K, N, sizes: skewed, empty, everything in one, nothing
    (300, 4, 128, 192, [40, 0, 100, 90]), (200, 3, 64, 128, [0, 200, 0]),
    (130, 2, 128, 64, [0, 0]), (100, 1, 64, 64, [7]),
    (300, 3, 64, 64, [64, 128, 50])]  # boundaries on the tiles: no block is cut but the last


@pytest.mark.parametrize("rows,groups,k,n,sizes", KERNEL_CASES)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_kernels_interpreted_values_and_gradients(interpreted_kernels, rows, groups, k, n, sizes,
                                                  transpose_w):
  rng = np.random.default_rng(rows + groups)
  x, w, gs = inputs(rng, rows, groups, k, n, sizes, dtype=jnp.bfloat16, transpose_w=transpose_w)
  assert jax_ep.grouped_matmul_impl(rows, groups, k, n, jnp.bfloat16)[0] == "mosaic"
  cot = _cotangent(rng, rows, n, gs, jnp.bfloat16)

  def loss(x, w):
    y = jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w, impl="mosaic")
    return _masked_loss(y, cot, gs), y
  (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
      poison_tail(x, gs), w)
  assert y.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
  assert_rows_close(y, oracle(x, w, gs, transpose_w), gs, 2e-2, 3e-2)
  want_dx, want_dw = _dense_grads(x, w, gs, cot, transpose_w)
  assert_rows_close(dx, want_dx, gs, 3e-2, 6e-2)
  assert np.isfinite(np.asarray(dw, np.float32)).all()
  np.testing.assert_allclose(np.asarray(dw, np.float32), want_dw, rtol=3e-2, atol=1e-1)


@pytest.mark.parametrize("compute_wgs", [1, 2])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_kernels_interpreted_groups_at_offsets(monkeypatch, compute_wgs, transpose_w):
  """Both forward kernels (one warpgroup; warp-specialized with two compute warpgroups) and
  two weight-gradient kernels (one warpgroup; warp-specialized with two compute warpgroups,
  which such tiles choose) with the groups at aligned offsets, NaN in the gaps."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  as_on_hopper(monkeypatch)
  tiles = KernelTiles(64, 64, 64, 2, 1, compute_wgs=compute_wgs)
  with plgpu.force_gpu_interpret_mode(), experts.override(gemm_tiles=tiles,
                                                          weight_grad_tiles=tiles):
    _check_at_offsets(np.random.default_rng(3), 384, 128, 128, [40, 0, 100, 1], 64,
                      transpose_w, jnp.bfloat16, 2e-2, impl="mosaic")


def test_weight_grad_at_two_ctas_per_sm_gives_one_ctas_bits():
  """Many groups take two persistent CTAs per SM (`configs.weight_grad_tiles`): each output tile
  is still one CTA's, reduced in the same order, so the bits are those of one CTA per SM, and
  rows past the groups (NaN) reach neither."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax_ep.experts import hopper_wgrad
  rng = np.random.default_rng(11)
  sizes = jnp.asarray([70, 0, 130, 5, 64, 31], jnp.int32)
  x = poison_tail(jnp.asarray(rng.standard_normal((320, 128)), jnp.bfloat16), sizes)
  dy = poison_tail(jnp.asarray(rng.standard_normal((320, 128)), jnp.bfloat16), sizes)
  one, two = (KernelTiles(64, 64, 64, 2, 1, ctas_per_sm=c) for c in (1, 2))
  with plgpu.force_gpu_interpret_mode(), experts.override(kernel_sms=3):
    got = {c.ctas_per_sm: np.asarray(hopper_wgrad.grouped_weight_grad_kernel(
        x, dy, sizes, tiles=c, specialized=False), np.float32) for c in (one, two)}
  np.testing.assert_array_equal(got[2], got[1])
  starts = np.cumsum(sizes) - sizes
  want = weight_grad_oracle(x, dy, starts, sizes)
  np.testing.assert_allclose(got[2], want, rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("specialized", [False, True])
@pytest.mark.parametrize("aligned", [False, True])
def test_weight_grad_reduces_128_rows_a_step(specialized, aligned):
  """`block_k` 128 (a tuning choice where groups hold a block or two of rows): groups that start
  and end inside blocks, an empty one, one of many blocks, rows past the groups (NaN, and the
  buffer not a whole number of blocks) reach no group's `x^T dy`."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax_ep.experts import hopper_wgrad
  rng = np.random.default_rng(13)
  sizes = jnp.asarray([70, 0, 130, 5, 64, 31, 200], jnp.int32)
  x = poison_tail(jnp.asarray(rng.standard_normal((600, 128)), jnp.bfloat16), sizes)
  dy = poison_tail(jnp.asarray(rng.standard_normal((600, 64)), jnp.bfloat16), sizes)
  with plgpu.force_gpu_interpret_mode(), experts.override(kernel_sms=3):
    got = np.asarray(hopper_wgrad.grouped_weight_grad_kernel(
        x, dy, sizes, tiles=KernelTiles(64, 64, 128, 2, 1), specialized=specialized,
        aligned=aligned), np.float32)
  starts = np.cumsum(sizes) - sizes
  want = weight_grad_oracle(x, dy, starts, sizes)
  assert not got[1].any()
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("aligned", [False, True])
def test_weight_grad_two_compute_warpgroups(aligned):
  """The warp-specialized weight gradient with two compute warpgroups (`compute_wgs` 2: each
  reduces half of the output tile's rows, both select away the rows outside the group in a cut
  block): groups that start and end inside blocks, an empty one, NaN past the groups; the
  same bits as one compute warpgroup (each output element is one warpgroup's, reduced in the
  same order)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax_ep.experts import hopper_wgrad
  rng = np.random.default_rng(17)
  sizes = jnp.asarray([70, 0, 130, 5, 64, 31], jnp.int32)
  x = poison_tail(jnp.asarray(rng.standard_normal((360, 256)), jnp.bfloat16), sizes)
  dy = poison_tail(jnp.asarray(rng.standard_normal((360, 128)), jnp.bfloat16), sizes)
  one, two = (KernelTiles(64, 64, 64, 2, 1, compute_wgs=w) for w in (1, 2))
  with plgpu.force_gpu_interpret_mode(), experts.override(kernel_sms=3):
    got = {c.compute_wgs: np.asarray(hopper_wgrad.grouped_weight_grad_kernel(
        x, dy, sizes, tiles=c, specialized=True, aligned=aligned), np.float32)
        for c in (one, two)}
  np.testing.assert_array_equal(got[2], got[1])
  starts = np.cumsum(sizes) - sizes
  np.testing.assert_allclose(got[2], weight_grad_oracle(x, dy, starts, sizes), rtol=2e-2,
                             atol=1e-1)
  with pytest.raises(ValueError, match="K=192 must be a multiple of 128"):
    hopper_wgrad.grouped_weight_grad_kernel(x[:, :192], dy, sizes, tiles=two, specialized=True)
  with pytest.raises(ValueError, match="compute_wgs=2 is a form of the warp-specialized"):
    hopper_wgrad.grouped_weight_grad_kernel(x, dy, sizes, tiles=two, specialized=False)


def test_group_steps_walk_each_groups_blocks_in_turn():
  """`layout.group_steps`: each group's row blocks one after another, none for an empty group,
  and each group's first step (then the total)."""
  first = jnp.asarray([0, 1, 1, 3, 4], jnp.int32)
  count = jnp.asarray([2, 0, 2, 1, 3], jnp.int32)
  block, group_first = layout.group_steps(first, count, 11)
  assert np.asarray(group_first).tolist() == [0, 2, 2, 4, 5, 8]
  assert np.asarray(block).tolist() == [0, 1, 1, 2, 3, 4, 5, 6, 0, 0, 0]


@pytest.mark.parametrize("block_k,run,aligned,offsets", [
    (64, 3, False, False), (128, 2, False, False), (64, 7, True, False), (64, 4, False, True),
    (128, 16, True, True)])
def test_weight_grad_in_runs_of_groups(block_k, run, aligned, offsets):
  """The weight gradient whose pipeline runs through `groups_per_run` groups (a run longer than
  the groups too; groups cut inside blocks, empty ones, one of many blocks; rows past and
  between the groups NaN): each group's `x^T dy`, and the same bits as the pipeline per group
  (each group's blocks reduced in the same order)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax_ep.experts import hopper_wgrad
  rng = np.random.default_rng(15)
  sizes = [70, 0, 130, 5, 64, 31, 200, 0]
  rows = 768
  if offsets:
    group_offsets, inside = aligned_layout(sizes, 16, rows)
  else:
    group_offsets, inside = None, np.arange(rows) < sum(sizes)
  gs = jnp.asarray(sizes, jnp.int32)
  mask = jnp.asarray(inside)[:, None]
  x = jnp.where(mask, jnp.asarray(rng.standard_normal((rows, 128)), jnp.bfloat16), jnp.nan)
  dy = jnp.where(mask, jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16), jnp.nan)
  tiles = KernelTiles(64, 64, block_k, 2, 1, groups_per_run=run)
  with plgpu.force_gpu_interpret_mode(), experts.override(kernel_sms=3):
    got, per_group = (np.asarray(hopper_wgrad.grouped_weight_grad_kernel(
        x, dy, gs, group_offsets, tiles=t, specialized=False, aligned=aligned), np.float32)
        for t in (tiles, dataclasses.replace(tiles, groups_per_run=1)))
  starts = np.cumsum(sizes) - sizes if group_offsets is None else np.asarray(group_offsets)
  np.testing.assert_array_equal(got, per_group)
  assert not got[[1, 7]].any()
  np.testing.assert_allclose(got, weight_grad_oracle(x, dy, starts, sizes), rtol=2e-2,
                             atol=1e-1)


def test_weight_grad_in_runs_names_what_it_needs():
  from jax_ep.experts import hopper_wgrad
  x = jnp.zeros((256, 128), jnp.bfloat16)
  sizes = jnp.asarray([100, 156], jnp.int32)
  for tiles, specialized in ((KernelTiles(64, 64, 64, 2, 1, groups_per_run=2), True),
                             (KernelTiles(64, 64, 64, 1, 1, groups_per_run=2), False)):
    with pytest.raises(ValueError, match="groups_per_run > 1 is a form of the one-warpgroup"):
      hopper_wgrad.grouped_weight_grad_kernel(x, x[:, :64], sizes, tiles=tiles,
                                        specialized=specialized)


@pytest.mark.parametrize("specialized", [False, True])
@pytest.mark.parametrize("offsets", [False, True])
def test_weight_grad_of_aligned_copies_selects_nothing_and_matches(specialized, offsets):
  """The weight gradient on aligned copies (`override(weight_grad_aligned=True)`'s path): each
  group starts a block, zeros after its rows; the kernel selects nothing away, and the result is
  the groups' `x^T dy` (NaN past and between the groups reaches none), an empty group's zeros."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax_ep.experts import hopper_wgrad
  rng = np.random.default_rng(12)
  sizes = [70, 0, 130, 5, 64, 31]
  rows = 448
  if offsets:
    group_offsets, inside = aligned_layout(sizes, 16, rows)
  else:
    group_offsets = None
    inside = np.arange(rows) < sum(sizes)
  gs = jnp.asarray(sizes, jnp.int32)
  mask = jnp.asarray(inside)[:, None]
  x = jnp.where(mask, jnp.asarray(rng.standard_normal((rows, 128)), jnp.bfloat16), jnp.nan)
  dy = jnp.where(mask, jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16), jnp.nan)
  src, count, _, _ = layout.aligned_blocks(gs, group_offsets, rows, 64)
  xa = layout.copy_aligned(x, src, count, 64)
  # Every block is one group's: the rows after a group's last are zeros, not NaN.
  assert np.isfinite(np.asarray(xa, np.float32)).all()
  with plgpu.force_gpu_interpret_mode(), experts.override(kernel_sms=3):
    got = np.asarray(hopper_wgrad.grouped_weight_grad_kernel(
        x, dy, gs, group_offsets, tiles=KernelTiles(64, 64, 64, 2, 1),
        specialized=specialized, aligned=True), np.float32)
  starts = (np.cumsum(sizes) - sizes) if group_offsets is None else np.asarray(group_offsets)
  want = weight_grad_oracle(x, dy, starts, sizes)
  assert not got[1].any()
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-1)


def test_the_gradient_through_aligned_copies_matches(interpreted_kernels, monkeypatch):
  """The override reaches `grouped_matmul`'s weight gradient: `x` and `dy` copied once each,
  the gradient the dense oracle's."""
  from jax_ep.experts import hopper_wgrad
  # A backward jax traced before (another test's, same shapes) would keep its trace.
  jax.clear_caches()
  copied = []
  monkeypatch.setattr(hopper_wgrad, "copy_aligned",
                      lambda a, *args: copied.append(a.shape) or layout.copy_aligned(a, *args))
  rng = np.random.default_rng(13)
  x, w, gs = inputs(rng, 300, 4, 128, 192, [40, 0, 100, 90], dtype=jnp.bfloat16)
  cot = _cotangent(rng, 300, 192, gs, jnp.bfloat16)

  def grad_w(x, w):
    return jax.grad(lambda w: _masked_loss(jax_ep.grouped_matmul(x, w, gs, impl="mosaic"), cot,
                                           gs))(w)
  with experts.override(weight_grad_aligned=True):
    got = jax.jit(grad_w)(poison_tail(x, gs), w)
  assert copied == [(300, 128), (300, 192)]  # x and dy, once each
  _, want_dw = _dense_grads(x, w, gs, cot, False)
  np.testing.assert_allclose(np.asarray(got, np.float32), want_dw, rtol=3e-2, atol=1e-1)


def test_kernels_interpreted_fall_back_where_the_tiles_do_not_divide(interpreted_kernels):
  x, w, gs = inputs(np.random.default_rng(5), 40, 2, 100, 64, [10, 20], dtype=jnp.bfloat16)
  name, why = jax_ep.grouped_matmul_impl(40, 2, 100, 64, jnp.bfloat16)
  assert name == "xla" and "K=100" in why
  assert_rows_close(jax_ep.grouped_matmul(x, w, gs), oracle(x, w, gs), gs, 2e-2, 3e-2)
  name, why = jax_ep.grouped_matmul_impl(40, 2, 128, 128, jnp.float32)
  assert name == "xla" and "bf16 or f16" in why


def test_a_known_build_is_not_compiled_by_the_choice(monkeypatch):
  """`builds.KNOWN_BUILDS` (compiled for sm_90a by tests/test_hopper_aot.py) need no probe."""
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  choice.mosaic_compile_error.cache_clear()
  built = []
  monkeypatch.setattr(choice, "grouped_matmul_kernel", lambda *a, **k: built.append(a))
  try:
    name, tiles = jax_ep.grouped_matmul_impl(256, 4, 128, 256, jnp.bfloat16)
    assert name == "mosaic" and builds.known_to_build(
        builds.gmm_build(jnp.bfloat16, False, tiles, jnp.bfloat16), 256)
    assert built == []
  finally:
    choice.mosaic_compile_error.cache_clear()


def test_a_known_build_at_rows_off_the_row_tiling_is_compiled(monkeypatch):
  """Mosaic fails to lower an operand whose row count is not a multiple of 8, whatever the
  build: at 777 rows the choice compiles its probe, and where it fails takes lax.ragged_dot."""
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  choice.mosaic_compile_error.cache_clear()

  def off_the_tiling(x, *args, **kwargs):
    assert x.shape[0] % 8, x.shape
    raise ValueError("dimension 0 must have size smaller or a multiple of its tiling 8")
  monkeypatch.setattr(choice, "grouped_matmul_kernel", off_the_tiling)
  try:
    for transpose_w in (False, True):
      name, why = jax_ep.grouped_matmul_impl(777, 5, 128, 192, jnp.bfloat16,
                                             transpose_w=transpose_w)
      assert name == "xla" and "multiple of its tiling 8" in why, (name, why)
    name, _ = jax_ep.grouped_matmul_impl(776, 5, 128, 192, jnp.bfloat16)
    assert name == "mosaic"
  finally:
    choice.mosaic_compile_error.cache_clear()


def test_falls_back_where_the_kernel_does_not_compile(monkeypatch):
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  monkeypatch.setattr(builds, "TRUST_KNOWN_BUILDS", False)  # the probe runs for every build
  choice.mosaic_compile_error.cache_clear()

  def does_not_build(*args, **kwargs):
    raise ValueError("Mosaic GPU kernel exceeds available shared memory")
  monkeypatch.setattr(choice, "grouped_matmul_kernel", does_not_build)
  try:
    name, why = jax_ep.grouped_matmul_impl(256, 4, 128, 256, jnp.bfloat16)
    assert name == "xla" and "did not compile for it (ValueError: Mosaic GPU kernel exceeds" in why
    x, w, gs = inputs(np.random.default_rng(9), 256, 4, 128, 256, [64] * 4, dtype=jnp.bfloat16)
    assert_rows_close(jax_ep.grouped_matmul(x, w, gs), oracle(x, w, gs), gs, 2e-2, 3e-2)
  finally:
    choice.mosaic_compile_error.cache_clear()


def test_tiles_that_do_not_build_fall_back_to_smaller_ones(monkeypatch):
  """A float32 result beside the warp-specialized kernel's stages can exceed shared memory:
  fewer stages are tried, then the one-warpgroup kernel, before lax.ragged_dot."""
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  tried = []

  def builds_below(limit):
    def error(rows, groups, k, n, dtype, transpose_w, config, out_dtype):
      tried.append(config)
      if np.dtype(out_dtype).itemsize == 4 and config.compute_wgs * config.stages > limit:
        return "exceeds available shared memory"
      return None
    return error
  shape = (32768, 256, 7168, 2048)
  table = configs.TILE_TABLES[("sm90", np.dtype(jnp.bfloat16))][shape[1:]]
  monkeypatch.setattr(choice, "mosaic_compile_error", builds_below(4))
  assert jax_ep.grouped_matmul_impl(*shape, jnp.bfloat16) == ("mosaic", table)
  name, config = jax_ep.grouped_matmul_impl(*shape, jnp.bfloat16, out_dtype=jnp.float32)
  assert name == "mosaic" and config == dataclasses.replace(table, stages=2)
  monkeypatch.setattr(choice, "mosaic_compile_error", builds_below(0))
  tried.clear()
  name, why = jax_ep.grouped_matmul_impl(*shape, jnp.bfloat16, out_dtype=jnp.float32)
  assert name == "xla" and "exceeds available shared memory" in why
  assert [c.compute_wgs for c in tried] == [2, 2, 1, 1, 1]  # 3 and 2 stages, then one warpgroup


def _shard_map_case(num_ranks, rng, rows=192, groups=2, k=64, n=128):
  """Per-rank operands stacked on a leading axis for a `num_ranks`-rank mesh: each rank its own
  rows, group sizes and experts, rows past the groups NaN."""
  shards = [inputs(rng, rows, groups, k, n, dtype=jnp.bfloat16) for _ in range(num_ranks)]
  xs = jnp.concatenate([poison_tail(x, gs) for x, _, gs in shards])
  ws = jnp.concatenate([w for _, w, _ in shards])
  gss = jnp.concatenate([gs for _, _, gs in shards])
  cots = jnp.concatenate([_cotangent(rng, rows, n, gs, jnp.bfloat16) for _, _, gs in shards])
  return shards, xs, ws, gss, cots


def _per_rank_loss(transpose_w=False):
  def loss(x, w, gs, cot):
    return _masked_loss(jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w), cot, gs)
  return loss


# NOTES: no jax.checkpoint here: the interpreter runs the kernels through ordered host
# callbacks, which remat refuses; the GPU test below runs the compiled kernels under it.
@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("wrap", ["plain", "vmap"])
def test_kernels_interpreted_inside_shard_map_under_grad(interpreted_kernels, monkeypatch,
                                                       wrap, runs):
  """The way the layer calls them: per-rank operands inside shard_map, gradients through the
  custom_vjp (whose cotangents must carry the primals' varying axes), and under vmap; the
  weight gradient per group or through runs of groups (`KernelTiles.groups_per_run`)."""
  # NOTES: one rank, the one-warpgroup kernels: with two interpreted devices the interpreter
  # now and then reports a barrier as still allocated at a kernel's end (always for the
  # warp-specialized kernels, once in a while for these), which one device never does. A rank
  # inside shard_map is what the typing of the kernels' results needs (the H200's failure was
  # at R=1); the GPU tests below run the warp-specialized defaults inside shard_map.
  from jax.sharding import NamedSharding, PartitionSpec as P
  num_ranks = 1
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])
  shards, xs, ws, gss, cots = _shard_map_case(num_ranks, np.random.default_rng(11))
  loss = _per_rank_loss()
  if wrap == "checkpoint":
    loss = jax.checkpoint(loss)

  def body(x, w, gs, cot):
    if wrap == "vmap":  # two micro-batches of half the rows, one set of experts
      half = x.shape[0] // 2
      fold = lambda a: a.reshape(2, half, *a.shape[1:])
      sizes = jnp.stack([jnp.minimum(gs, jnp.maximum(half - jnp.cumsum(gs) + gs, 0)),
                         jnp.zeros_like(gs)])
      grads = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None, 0, 0))(
          jnp.nan_to_num(fold(x)), w, sizes, fold(cot))
      return grads[0].reshape(x.shape), jnp.sum(grads[1], 0)
    return jax.grad(loss, (0, 1))(x, w, gs, cot)

  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4,
                             out_specs=(P("ep"), P("ep"))))
  tiles = dataclasses.replace(SMALL_TILES, groups_per_run=2) if runs else SMALL_TILES
  jax.clear_caches()  # a backward traced under the other tiles would keep its trace
  with experts.override(weight_grad_tiles=tiles):
    dx, dw = (np.asarray(a, np.float32) for a in fn(put(xs), put(ws), put(gss), put(cots)))
  rows = shards[0][0].shape[0]
  for r, (x, w, gs) in enumerate(shards):
    if wrap == "vmap":
      gs = jnp.minimum(gs, jnp.maximum(rows // 2 - jnp.cumsum(gs) + gs, 0))
    want_dx, want_dw = _dense_grads(x, w, gs, cots[r * rows:(r + 1) * rows], False)
    assert_rows_close(dx[r * rows:(r + 1) * rows], want_dx, gs, 3e-2, 6e-2)
    got_dw = dw[r * w.shape[0]:(r + 1) * w.shape[0]]
    assert np.isfinite(got_dw).all()
    np.testing.assert_allclose(got_dw, want_dw, rtol=3e-2, atol=1e-1)


@pytest.mark.parametrize("hidden,ffn", [(7168, 2048), (2048, 768), (4096, 1536), (4096, 14336)])
def test_the_layer_traces_to_the_kernels_on_hopper(monkeypatch, hidden, ffn):
  """At the models' hidden and ffn sizes (DeepSeek-V3, Qwen3-30B-A3B, 32 x 4096 x 1536,
  Mixtral) the layer's forward and backward trace to seven kernel calls (the fused gate-up,
  down, the fused activation derivative, the input gradient of both projections, three weight
  gradients) and no lax.ragged_dot, as on a Hopper GPU (traced here, not run); with the fused
  expert kernels turned off, nine (gate, up, down, and each one's input and weight
  gradients)."""
  as_on_hopper(monkeypatch)
  monkeypatch.setattr(mlp, "fused_compile_error", lambda *args: None)
  num_experts, num_topk, tokens = 8, 2, 64
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  group = jax_ep.Group(mesh, "ep", num_experts=num_experts, num_topk=num_topk, hidden=hidden,
                       max_tokens_per_rank=tokens, dtype=jnp.bfloat16, backend="reference")
  params = jax.eval_shape(lambda: jax_ep.init_moe_params(
      jax.random.key(0), num_experts=num_experts, hidden=hidden, ffn=ffn, dtype=jnp.bfloat16))
  x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
  loss = lambda p, x: jnp.sum(jax_ep.moe_mlp(group, p, x).out.astype(jnp.float32))
  assert grouped_matmul_kernels(jax.value_and_grad(loss, (0, 1)), params, x) == (7, 0)
  with experts.override(fused_mlp=False):
    assert grouped_matmul_kernels(jax.value_and_grad(loss, (0, 1)), params, x) == (9, 0)


# ------------------------------------------------------------------ the kernels, on a GPU

GPU_SHAPES = [  # rows, groups, K, N, sizes: skewed, empty groups, rows past the groups; kernel
    (1024, 8, 256, 512, [1000, 0, 0, 24, 0, 0, 0, 0], True),
    # Rows not a multiple of 8 (the kernel's row tiling): it does not build (logged), ragged_dot.
    (777, 5, 128, 192, [0, 300, 0, 200, 150], False),
    (4096, 32, 512, 256, None, True),
    (2048, 4, 256, 256, [0, 0, 0, 0], True),
    (300, 3, 100, 128, [100, 100, 50], False),    # K not a multiple of the tile: lax.ragged_dot
    (300, 3, 128, 100, [0, 200, 50], False),      # N not a multiple of the tile: lax.ragged_dot
]


def _f32_reference(x, w, gs, cot, transpose_w):
  """lax.ragged_dot in float32 on the upcast operands: y, dx, dw."""
  xf, wf, cf = (a.astype(jnp.float32) for a in (jnp.nan_to_num(x), w, jnp.nan_to_num(cot)))

  def loss(x, w):
    w_kn = jnp.swapaxes(w, 1, 2) if transpose_w else w
    y = jax.lax.ragged_dot(x, w_kn, gs, precision=jax.lax.Precision.HIGHEST)
    return _masked_loss(y, cf, gs), y
  (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(xf, wf)
  return y, dx, dw


# The kernels accumulate in float32 and round once to bf16 (relative error at most 2^-9 an
# element): each group's relative error against the float32 product stays far below this,
# and a 1 % change of a result exceeds it (each check shows that too).
GROUP_BOUND = 5e-3


def _group_errors(got, want, gs, per_row_groups, scale=1.0):
  """Relative error `|scale * got - want| / |want|` of each group: its rows (`per_row_groups`:
  `y`, `dx`) or its slice of the leading axis (`dw`); nan for an all-zero reference."""
  got, want = np.asarray(got, np.float64) * scale, np.asarray(want, np.float64)
  if per_row_groups:
    bounds = np.concatenate([[0], np.cumsum(np.asarray(gs))])
    blocks = [(got[a:b], want[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
  else:
    blocks = list(zip(got, want))
  return np.array([np.linalg.norm(g - w) / np.linalg.norm(w) if np.any(w) else
                   (0.0 if not np.any(g) else np.inf) for g, w in blocks])


def _assert_close_to(got, want, gs, what, rows_only=True):
  assert np.isfinite(np.asarray(used_rows(got, gs) if rows_only else got, np.float64)).all(), (
      f"{what}: not finite")
  errors = _group_errors(got, want, gs, rows_only)
  assert (errors[~np.isnan(errors)] <= GROUP_BOUND).all(), (
      f"{what}: relative error per group {np.round(errors, 5).tolist()} > {GROUP_BOUND:g}")
  mutated = _group_errors(got, want, gs, rows_only, scale=1.01)
  if np.any(np.asarray(gs) > 0):
    assert not (mutated[~np.isnan(mutated)] <= GROUP_BOUND).all(), (
        f"{what}: the bound does not see a 1 % change")


def _assert_kernels(fn, args, kernel, calls=3):
  """The products ran where the test says: jax_ep's Mosaic GPU kernels (`calls` of them: the
  forward, the input and the weight gradients) and no lax.ragged_dot, or (`kernel` False, a
  shape its tiles do not divide) lax.ragged_dot alone."""
  mosaic, ragged = grouped_matmul_kernels(fn, *args)
  if kernel:
    assert mosaic >= calls and ragged == 0, (mosaic, ragged)
  else:
    assert mosaic == 0 and ragged == calls, (mosaic, ragged)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,groups,k,n,sizes,kernel", GPU_SHAPES)
@pytest.mark.parametrize("transpose_w", [False, True])
def test_on_the_gpu_against_f32_ragged_dot(rows, groups, k, n, sizes, kernel, transpose_w):
  require_hopper()
  rng = np.random.default_rng(rows)
  x, w, gs = inputs(rng, rows, groups, k, n, sizes, dtype=jnp.bfloat16, transpose_w=transpose_w)
  x = poison_tail(x, gs)
  cot = _cotangent(rng, rows, n, gs, jnp.bfloat16)

  def loss(x, w):
    y = jax_ep.grouped_matmul(x, w, gs, transpose_w=transpose_w)
    return _masked_loss(y, cot, gs), y
  step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
  _assert_kernels(step, (x, w), kernel)
  (_, y), (dx, dw) = step(x, w)
  y_ref, dx_ref, dw_ref = _f32_reference(x, w, gs, cot, transpose_w)
  _assert_close_to(y, y_ref, gs, "y")
  _assert_close_to(dx, dx_ref, gs, "dx")
  _assert_close_to(dw, dw_ref, gs, "dw", rows_only=False)


@pytest.mark.gpu
@pytest.mark.parametrize("weight_grad", ["in_place", "aligned", "runs"])
@pytest.mark.parametrize("wrap", ["plain", "checkpoint", "vmap"])
def test_on_the_gpu_inside_shard_map_under_grad(wrap, weight_grad):
  """The kernels as the layer calls them on one GPU: inside shard_map (R = 1), under grad,
  jax.checkpoint and vmap, rows past the groups NaN; the weight gradient on the rows in place,
  on aligned copies (`override(weight_grad_aligned=True)`) and through runs of groups
  (`KernelTiles.groups_per_run`)."""
  require_hopper()
  # A backward jax traced before under the other setting would keep its trace.
  jax.clear_caches()
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  rng = np.random.default_rng(12)
  rows, groups, k, n = 2048, 8, 256, 512
  x, w, gs = inputs(rng, rows, groups, k, n, [700, 0, 300, 1, 0, 500, 0, 200],
                    dtype=jnp.bfloat16)
  x = poison_tail(x, gs)
  cot = _cotangent(rng, rows, n, gs, jnp.bfloat16)
  assert jax_ep.grouped_matmul_impl(rows, groups, k, n, jnp.bfloat16)[0] == "mosaic"
  loss = _per_rank_loss()
  if wrap == "checkpoint":
    loss = jax.checkpoint(loss)

  def body(x, w, gs, cot):
    if wrap == "vmap":
      grads = jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None, 0, 0))(
          x[None], w, gs[None], cot[None])
      return grads[0][0], grads[1][0]
    return jax.grad(loss, (0, 1))(x, w, gs, cot)

  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 4,
                             out_specs=(P("ep"), P("ep"))))
  args = (put(x), put(w), put(gs), put(cot))
  runs = KernelTiles(128, 128, 64, 3, 4, ctas_per_sm=2, groups_per_run=4)
  with experts.override(weight_grad_aligned=weight_grad == "aligned",
                        weight_grad_tiles=runs if weight_grad == "runs" else None):
    _assert_kernels(fn, args, True)  # (jax.checkpoint runs the forward twice)
    dx, dw = fn(*args)
  _, dx_ref, dw_ref = _f32_reference(x, w, gs, cot, False)
  _assert_close_to(dx, dx_ref, gs, "dx")
  _assert_close_to(dw, dw_ref, gs, "dw", rows_only=False)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [
    KernelTiles(128, 64, 128, 2, 4, ctas_per_sm=2), KernelTiles(128, 128, 128, 2, 4),
    KernelTiles(128, 64, 64, 2, 4, ctas_per_sm=3)], ids=["bk128-2cta", "bk128", "3cta"])
@pytest.mark.parametrize("specialized", [False, True])
def test_on_the_gpu_weight_grad_tile_variants(tiles, specialized):
  """The weight gradient's kernels at the tiles `bench_layer.py --tune` also tries (128 rows a
  step; three CTAs an SM) against the float32 product, many skewed groups (empty ones, one of
  many blocks), NaN past the groups."""
  require_hopper()
  from jax_ep.experts import hopper_wgrad
  rng = np.random.default_rng(14)
  sizes = jnp.asarray([300, 0, 129, 1, 64, 0, 700, 127, 5, 0, 250, 128, 31, 0, 200, 66],
                      jnp.int32)
  rows, k, n = 2304, 512, 256
  x = poison_tail(jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16), sizes)
  dy = poison_tail(jnp.asarray(rng.standard_normal((rows, n)), jnp.bfloat16), sizes)
  got = np.asarray(jax.jit(lambda x, dy, s: hopper_wgrad.grouped_weight_grad_kernel(
      x, dy, s, tiles=tiles, specialized=specialized))(x, dy, sizes), np.float32)
  starts = np.cumsum(sizes) - sizes
  want = weight_grad_oracle(x, dy, starts, sizes)
  for g in np.flatnonzero(np.asarray(sizes) == 0):
    assert not got[g].any(), f"empty group {g}"
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-1)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [
    KernelTiles(128, 128, 64, 3, 4, ctas_per_sm=2, groups_per_run=4),
    KernelTiles(128, 128, 128, 2, 4, groups_per_run=16),
    KernelTiles(128, 64, 64, 4, 4, groups_per_run=64)], ids=["run4-2cta", "bk128-run16", "run64"])
def test_on_the_gpu_weight_grad_in_runs_of_groups(tiles):
  """The weight gradient through runs of groups on the GPU: the same bits as the pipeline per
  group with the same tiles, and the float32 product, many skewed groups (empty ones, one of
  many blocks, runs that end inside the groups and a run longer than them), NaN past the
  groups."""
  require_hopper()
  from jax_ep.experts import hopper_wgrad
  rng = np.random.default_rng(16)
  sizes = jnp.asarray([300, 0, 129, 1, 64, 0, 700, 127, 5, 0, 250, 128, 31, 0, 200, 66, 3],
                      jnp.int32)
  rows, k, n = 2400, 512, 256
  x = poison_tail(jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16), sizes)
  dy = poison_tail(jnp.asarray(rng.standard_normal((rows, n)), jnp.bfloat16), sizes)
  kernel = hopper_wgrad.grouped_weight_grad_kernel
  got, per_group = (np.asarray(jax.jit(lambda x, dy, s, t=t: kernel(
      x, dy, s, tiles=t, specialized=False))(x, dy, sizes), np.float32)
      for t in (tiles, dataclasses.replace(tiles, groups_per_run=1)))
  np.testing.assert_array_equal(got, per_group)
  starts = np.cumsum(sizes) - sizes
  for g in np.flatnonzero(np.asarray(sizes) == 0):
    assert not got[g].any(), f"empty group {g}"
  np.testing.assert_allclose(got, weight_grad_oracle(x, dy, starts, sizes), rtol=2e-2,
                             atol=2e-1)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [
    dict(block_m=128, compute_wgs=1, stages=4), dict(block_m=64, compute_wgs=1, stages=4),
    dict(block_m=128, compute_wgs=2, stages=3), dict(block_m=64, compute_wgs=2, stages=4)])
@pytest.mark.parametrize("alignment", [1, 128])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_on_the_gpu_kernel_variants_and_groups_at_offsets(tiles, alignment, transpose_w):
  """Each forward kernel (one warpgroup; warp-specialized) at both row tiles and the three
  weight-gradient kernels, the groups contiguous or at offsets aligned to the row tile, skewed
  and empty groups, NaN outside."""
  require_hopper()
  config = KernelTiles(block_n=128, block_k=64, band=4, **tiles)
  # The weight gradient: its default at 16 groups (two compute warpgroups) beside the forward's
  # two warpgroups, else one compute warpgroup, warp-specialized or not.
  weight_grad = None if tiles["compute_wgs"] == 2 else KernelTiles(128, 128, 64, 4, 4)
  sizes = [900, 0, 0, 37, 1, 0, 300, 128, 0, 64, 2, 0, 0, 500, 0, 3]
  with experts.override(gemm_tiles=config, weight_grad_tiles=weight_grad,
                        weight_grad_specialized=tiles["block_m"] == 128):
    _check_at_offsets(np.random.default_rng(alignment), 4096, 512, 768, sizes, alignment,
                      transpose_w, jnp.bfloat16, 2e-2, impl="mosaic")
