"""The FP8 expert recipe: `jax_ep.quantize_weights`, `jax_ep.grouped_matmul_fp8`,
`jax_ep.expert_mlp(..., fp8=True)` and the layer's `fp8=True`.

Oracles:
- the weights' blocks against a numpy closed form (`scale = amax / 448` per 128 x 128 block,
  values rounded to nearest even by ml_dtypes): bit-exact;
- the FP8 product against float64 numpy of the dequantised operands: the products of e4m3
  values are exact in fp32 and only the fp32 sums and the one rounding to bf16 differ, so the
  bound is bf16's half ulp of each entry plus fp32 sums' `K * 2^-24` of the row's scale;
- the FP8 MLP, its gradients and the FP8 layer against the same computation in float32
  without quantisation (bounded: cosine >= 0.99 and relative norm <= 0.1 (`FP8_BOUNDS`), from
  e4m3's 2^-4 relative step, a few roundings deep), and against each other where they must be
  bit-exact: the fp8 dispatch's rows are the rows the experts would quantise themselves, weights
  quantised once or per call are the same weights, micro-batches see the same rows;
- the training check (tests/test_example.py): the end-to-end model trained from the same seed
  with its experts in FP8 ends within 2 % of its bf16 loss.
"""

from __future__ import annotations

import functools

import ml_dtypes
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep._native.fp8 import fp8_quantize, pack_ue8m0
from jax_ep.experts.fp8 import Fp8Weights
from test_layer import make_group, new_group  # noqa: F401 - a fixture

F32 = jnp.float32
BF16 = jnp.bfloat16
# The FP8 recipe against unquantised float32: (min cosine, max relative norm of the error).
FP8_BOUNDS = (0.99, 0.1)


def _layout(sizes, alignment, rows):
  sizes = np.asarray(sizes, np.int32)
  padded = -(-sizes // alignment) * alignment
  offsets = (np.cumsum(padded) - padded).astype(np.int32)
  assert offsets[-1] + sizes[-1] <= rows
  inside = np.zeros(rows, bool)
  group_of = np.zeros(rows, np.int64)
  for g, (s, o) in enumerate(zip(sizes, offsets)):
    inside[o:o + s] = True
    group_of[o:o + s] = g
  return sizes, offsets, inside, group_of


def _weights(rng, groups, k, n):
  return jnp.asarray(rng.standard_normal((groups, k, n)) * k ** -0.5, F32)


def _cosine_and_norm(got, want):
  got, want = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
  cosine = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
  return cosine, np.linalg.norm(got - want) / np.linalg.norm(want)


def assert_fp8_close(got, want, what):
  cosine, rel = _cosine_and_norm(got, want)
  assert cosine >= FP8_BOUNDS[0] and rel <= FP8_BOUNDS[1], (
      f"{what}: cosine {cosine:.5f}, relative norm {rel:.4f} against {FP8_BOUNDS}")


# ------------------------------------------------------------------------ the weights' blocks
def test_quantize_weights_matches_the_block_closed_form():
  rng = np.random.default_rng(0)
  w = np.asarray(rng.standard_normal((3, 256, 384)) * 3.0, np.float32)
  w[1, :128, 128:256] = 0.0  # an all-zero block: scale 1, values 0
  got = jax_ep.quantize_weights(jnp.asarray(w))
  assert got.values.shape == (3, 384, 256) and got.values.dtype == jnp.float8_e4m3fn
  assert got.scales.shape == (3, 3, 2) and got.scales.dtype == F32
  assert got.shape == (3, 256, 384)
  blocks = w.transpose(0, 2, 1).reshape(3, 3, 128, 2, 128)
  amax = np.nanmax(np.abs(blocks), axis=(2, 4))
  scales = np.where(amax > 0, amax * np.float32(1 / 448), 1).astype(np.float32)
  values = (blocks * (np.float32(1) / scales)[:, :, None, :, None]).astype(
      ml_dtypes.float8_e4m3fn)
  np.testing.assert_array_equal(np.asarray(got.scales), scales)
  np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8),
                                values.reshape(3, 384, 256).view(np.uint8))
  assert np.asarray(got.scales)[1, 1, 0] == 1.0
  # The dequantised weight is within e4m3's half step of each block's largest entry.
  err = np.abs(np.asarray(got.dequantize()) - w)
  bound = np.repeat(np.repeat(amax.transpose(0, 2, 1), 128, 1), 128, 2) * 2.0 ** -4
  assert np.all(err <= bound + 1e-30)


def test_quantize_weights_passes_the_gradient_straight_through():
  w = jnp.asarray(np.random.default_rng(1).standard_normal((2, 128, 256)), BF16)
  c = jnp.asarray(np.random.default_rng(2).standard_normal((2, 128, 256)), F32)
  grad = jax.grad(lambda w: jnp.sum(jax_ep.quantize_weights(w).dequantize() * c))(w)
  assert grad.dtype == BF16
  np.testing.assert_array_equal(np.asarray(grad, np.float32),
                                np.asarray(c.astype(BF16), np.float32))


def _block_closed_form(w):
  """numpy's `(values [G, N, K] e4m3, scales [G, N/128, K/128])` of `w` `[G, K, N]`: amax / 448
  per 128 x 128 block (1 for an all-zero block, a NaN left out), `w * (1 / scale)` rounded to
  nearest even."""
  w = np.asarray(w, np.float32)
  g, k, n = w.shape
  blocks = w.transpose(0, 2, 1).reshape(g, n // 128, 128, k // 128, 128)
  amax = np.nanmax(np.abs(blocks), axis=(2, 4))
  scales = np.where(amax > 0, amax * np.float32(1 / 448), 1).astype(np.float32)
  values = (blocks * (np.float32(1) / scales)[:, :, None, :, None]).astype(
      ml_dtypes.float8_e4m3fn)
  return values.reshape(g, n, k), scales


def _wide_weights(dtype, seed=3):
  """`[3, 256, 384]` weights over 16 binades per column, one all-zero block, a NaN in
  another."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((3, 256, 384)) * np.exp2(rng.uniform(-8, 8, (3, 1, 384)))
  w[1, :128, :128] = 0.0
  w[2, 130, 300] = np.nan
  return jnp.asarray(w, dtype)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_the_quantisation_kernel_is_the_closed_form(dtype):
  """The one-pass kernel (interpreted) against numpy, bit for bit: every block's scale and
  every value, transposed, with the all-zero block's scale 1."""
  from jax_ep.experts.quantize_kernel import quantize_weight_blocks
  w = _wide_weights(dtype)
  values, scales = jax.jit(lambda w: quantize_weight_blocks(w, interpret=True))(w)
  want_values, want_scales = _block_closed_form(w)
  np.testing.assert_array_equal(np.asarray(scales), want_scales)
  np.testing.assert_array_equal(np.asarray(values).view(np.uint8), want_values.view(np.uint8))
  assert np.asarray(scales)[1, 0, 0] == 1.0
  # The NaN's block ([N/128, K/128] = [2, 1]) keeps its other values' scale.
  assert np.isnan(np.asarray(values, np.float32)[2, 300, 130])
  assert np.isfinite(np.asarray(scales)).all() and np.asarray(scales)[2, 2, 1] != 1.0


def test_quantize_weights_takes_the_kernel_where_the_fp8_kernels_run(monkeypatch):
  """On Hopper (as the choice sees it here) `quantize_weights` is the kernel, under `jit` and
  `vmap`, its gradient straight through; with `experts.override(impl="xla")` XLA's two passes:
  the same bits, the closed form's."""
  from jax_ep import experts
  from jax_ep.experts import choice, quantize_kernel
  calls = []
  real = quantize_kernel.quantize_weight_blocks
  monkeypatch.setattr(quantize_kernel, "quantize_weight_blocks",
                      lambda w: calls.append(w.shape) or real(w, interpret=True))
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  w = _wide_weights(BF16)
  want_values, want_scales = _block_closed_form(w)
  got = jax.jit(jax_ep.quantize_weights)(w)
  assert calls == [(3, 256, 384)]
  np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8),
                                want_values.view(np.uint8))
  c = jnp.asarray(np.random.default_rng(4).standard_normal((3, 256, 384)), F32)
  grad = jax.jit(jax.grad(lambda w: jnp.sum(jax_ep.quantize_weights(w).dequantize() * c)))(w)
  np.testing.assert_array_equal(np.asarray(grad, np.float32),
                                np.asarray(c.astype(BF16), np.float32))
  # Under vmap: the kernel over a leading axis (Pallas adds it to the grid), each weight's own.
  batched = jax.jit(jax.vmap(jax_ep.quantize_weights))(jnp.stack([w, w * 4]))
  for i, one in enumerate((w, w * 4)):
    values, scales = _block_closed_form(one)
    np.testing.assert_array_equal(np.asarray(batched.values[i]).view(np.uint8),
                                  values.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(batched.scales[i]), scales)
  with experts.override(impl="xla"):
    xla = jax.jit(jax_ep.quantize_weights)(w)
  assert len(calls) == 3  # the call, the gradient's forward, the vmap; not XLA's path
  np.testing.assert_array_equal(np.asarray(xla.scales), want_scales)
  np.testing.assert_array_equal(np.asarray(xla.values).view(np.uint8),
                                want_values.view(np.uint8))


@pytest.mark.gpu
def test_the_quantisation_kernel_on_hopper():
  """The kernel as the FP8 layer runs it, at one rank of DeepSeek-V3 at EP=8's weight shape,
  against numpy bit for bit (PTX's IEEE reciprocal), a NaN left out of its block's amax."""
  from ep_test_base import require_hopper
  require_hopper()
  w = jax.random.normal(jax.random.key(5), (32, 7168, 2048), jnp.float32).astype(BF16)
  w = w.at[2, 130, 300].set(jnp.nan)
  got = jax.jit(jax_ep.quantize_weights)(w)
  want_values, want_scales = _block_closed_form(w)
  np.testing.assert_array_equal(np.asarray(got.scales), want_scales)
  np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8),
                                want_values.view(np.uint8))


def _activation_grad_case(rows, ffn, seed=11):
  """`dh` float32 `[rows, F]` over 12 binades per row, one all-zero and one NaN row; the saved
  gate and up in bf16."""
  rng = np.random.default_rng(seed)
  dh = rng.standard_normal((rows, ffn)) * np.exp2(rng.uniform(-6, 6, (rows, 1)))
  dh[1] = 0.0
  dh[2, :5] = np.nan
  gate = rng.standard_normal((rows, ffn)) * 3
  up = rng.standard_normal((rows, ffn))
  return jnp.asarray(dh, F32), jnp.asarray(gate, BF16), jnp.asarray(up, BF16)


def _activation_grad_xla(dh, gate, up, activation):
  """The backward's XLA path: the cotangents in float32, each `fp8_quantize`d, side by side."""
  from jax_ep._native.fp8 import fp8_quantize
  from jax_ep.experts.mlp import act, act_grad
  g = gate.astype(F32)
  if up is not None:
    parts = (dh * up.astype(F32) * act_grad(g, activation), dh * act(g, activation))
  else:
    parts = (dh * act_grad(g, activation),)
  q, scales = zip(*[fp8_quantize(d) for d in parts])
  return (jnp.concatenate(q, axis=1), jnp.concatenate(scales, axis=1),
          jnp.concatenate([d.astype(BF16) for d in parts], axis=1))


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "silu", "gelu"])
def test_the_activation_gradient_kernel_is_xlas_path(activation):
  """The FP8 MLP's activation gradient in one pass (interpreted) against the backward's XLA
  path, both jitted: `[dgate | dup]`'s e4m3 values and per-row scales and the bf16 copies the
  weight gradients take, bit for bit; an all-zero row scales by 1, a NaN stays in its element
  and out of its block's scale."""
  from jax_ep.experts.quantize_kernel import activation_grad_blocks
  dh, gate, up = _activation_grad_case(64, 256)
  up = up if activation in ("swiglu", "geglu") else None
  got = jax.jit(lambda *a: activation_grad_blocks(*a, activation, interpret=True))(dh, gate, up)
  want = jax.jit(lambda *a: _activation_grad_xla(*a, activation))(dh, gate, up)
  parts = 2 if up is not None else 1
  assert got[0].shape == (64, parts * 256) and got[1].shape == (64, parts * 2)
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8),
                                np.asarray(want[0]).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  assert got[2].shape == (64, parts * 256)
  np.testing.assert_array_equal(np.asarray(got[2], F32), np.asarray(want[2], F32))
  assert (np.asarray(got[1])[1] == 1.0).all()
  q = np.asarray(got[0], F32)
  assert np.isnan(q[2, :5]).all() and np.isfinite(q[2, 5:128]).all()


def _rows_case(rows, hidden, dtype, seed=12):
  """Rows over 16 binades, one all-zero row and one with NaNs."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, hidden)) * np.exp2(rng.uniform(-8, 8, (rows, 1)))
  x[1] = 0.0
  x[2, :3] = np.nan
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_the_row_quantisation_kernel_is_fp8_quantize(dtype):
  """Rows quantised per 128 channels in one pass (interpreted) against `fp8_quantize`, both
  jitted: values and scales bit for bit, the all-zero row's scale 1, NaNs in their elements."""
  from jax_ep.experts.quantize_kernel import quantize_row_blocks
  x = _rows_case(64, 384, dtype)
  q, scales = jax.jit(lambda x: quantize_row_blocks(x, interpret=True))(x)
  want_q, want_scales = jax.jit(fp8_quantize)(x)
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(want_q).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
  assert (np.asarray(scales)[1] == 1.0).all()
  assert np.isnan(np.asarray(q, F32)[2, :3]).all()


def _assert_within_one_e4m3_step(q, want):
  """Each value NaN where `want`'s is, else within one e4m3 step of it (2^-3 relative, 2^-9
  of its scale among the subnormals)."""
  q, want = np.asarray(q, F32), np.asarray(want, F32)
  ok = np.where(np.isnan(want), np.isnan(q), np.abs(q - want) <= 2.0 ** -3 * np.abs(want) +
                2.0 ** -9)
  bad = np.argwhere(~ok)
  assert not bad.size, (f"{len(bad)} of {q.size} values not within one e4m3 step, e.g. at "
                        f"{[tuple(map(int, i)) for i in bad[:4]]}: {[q[tuple(i)] for i in bad[:4]]}"
                        f" where {[want[tuple(i)] for i in bad[:4]]}")


@pytest.mark.gpu
def test_the_row_quantisation_kernel_on_hopper():
  """The kernel as the FP8 MLP's backward runs it on `dy`, at one rank of DeepSeek-V3 at
  EP=8 (32768 x 7168 bf16), against `fp8_quantize` on the same GPU: the scales bit for bit;
  each value the same or, where XLA divides by the scale rather than multiplying by its
  reciprocal (the two round apart at an e4m3 boundary), one step away."""
  from ep_test_base import require_hopper
  from jax_ep.experts.quantize_kernel import quantize_row_blocks
  require_hopper()
  x = _rows_case(32768, 7168, BF16)
  q, scales = jax.jit(quantize_row_blocks)(x)
  want_q, want_scales = jax.jit(fp8_quantize)(x)
  np.testing.assert_array_equal(np.asarray(scales), np.asarray(want_scales))
  _assert_within_one_e4m3_step(q, want_q)


@pytest.mark.gpu
def test_the_activation_gradient_kernel_on_hopper():
  """The kernel as the FP8 MLP's backward runs it, at one rank of DeepSeek-V3 at EP=8
  (32768 rows, F = 2048), against the XLA path on the same GPU: the float32 cotangents may
  differ by the compilers' fused multiply-adds, so each scale within 1e-6 of XLA's, each e4m3
  value within one step (2^-3 relative, 2^-9 of its scale among the subnormals), each bf16
  copy within one ulp."""
  from ep_test_base import require_hopper
  from jax_ep.experts.quantize_kernel import activation_grad_blocks
  require_hopper()
  dh, gate, up = _activation_grad_case(32768, 2048)
  got = jax.jit(lambda *a: activation_grad_blocks(*a, "swiglu"))(dh, gate, up)
  want = jax.jit(lambda *a: _activation_grad_xla(*a, "swiglu"))(dh, gate, up)
  scales, want_scales = np.asarray(got[1]), np.asarray(want[1])
  np.testing.assert_allclose(scales, want_scales, rtol=1e-6)
  _assert_within_one_e4m3_step(got[0], want[0])
  g, w = np.asarray(got[2], F32), np.asarray(want[2], F32)
  np.testing.assert_allclose(g[~np.isnan(w)], w[~np.isnan(w)], rtol=2.0 ** -7, atol=0)


def test_quantize_weights_of_a_weight_sharded_over_explicit_axes():
  """A global weight laid out over the experts on an Explicit mesh (as a model's parameters are
  under `jax.set_mesh`): quantised shard by shard, the same bits as unsharded, each result laid
  out over the experts as the weight; dequantised and differentiated the same way."""
  from jax.sharding import NamedSharding
  mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  w = _wide_weights(F32)
  w = jnp.concatenate([w, w[:1]])  # four experts, one a shard
  c = jnp.asarray(np.random.default_rng(5).standard_normal(w.shape), F32)
  want = jax_ep.quantize_weights(w)
  want_grad = jax.grad(lambda w: jnp.sum(jax_ep.quantize_weights(w).dequantize() * c))(w)
  sharded = jax.device_put(w, NamedSharding(mesh, P("ep")))
  with jax.set_mesh(mesh):
    got = jax.jit(jax_ep.quantize_weights)(sharded)
    assert str(jax.typeof(got.values).sharding.spec) == str(P("ep", None, None))
    dequantised = jax.jit(lambda q: q.dequantize())(got)
    grad = jax.jit(jax.grad(lambda w: jnp.sum(jax_ep.quantize_weights(w).dequantize() * c)))(
        sharded)
  np.testing.assert_array_equal(np.asarray(got.values, F32), np.asarray(want.values, F32))
  np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(want.scales))
  np.testing.assert_array_equal(np.asarray(dequantised), np.asarray(want.dequantize()))
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_grad))
  # Sharded along K, each shard's K (64) is not a multiple of the blocks' 128.
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"each shard's blocks .* \(64, 384\)"):
    jax_ep.quantize_weights(jax.device_put(w, NamedSharding(mesh, P(None, "ep"))))


@pytest.mark.parametrize("shape,match", [
    ((2, 100, 128), "multiples of 128"), ((128, 128), r"\[G, K, N\]")])
def test_quantize_weights_refuses_what_it_cannot_scale(shape, match):
  with pytest.raises(ValueError, match=match):
    jax_ep.quantize_weights(jnp.zeros(shape, F32))


# --------------------------------------------------------------------------- the FP8 product
@pytest.mark.parametrize("alignment", [1, 128])
def test_grouped_matmul_fp8_matches_the_dequantised_product(alignment):
  rng = np.random.default_rng(3)
  rows, k, n = 768, 256, 384
  sizes, offsets, inside, group_of = _layout([130, 0, 257, 70], alignment, rows)
  x = np.asarray(rng.standard_normal((rows, k)), np.float32)
  x[~inside] = np.nan  # rows outside the groups reach no result
  x_q, x_scales = fp8_quantize(jnp.asarray(x, BF16))
  w = jax_ep.quantize_weights(_weights(rng, 4, k, n))
  got = jax_ep.grouped_matmul_fp8(x_q, x_scales, w, jnp.asarray(sizes),
                                  group_offsets=jnp.asarray(offsets))
  assert got.shape == (rows, n) and got.dtype == BF16
  xd = np.asarray(x_q, np.float64) * np.repeat(np.asarray(x_scales, np.float64), 128, 1)
  wd = np.asarray(w.dequantize(), np.float64)
  want = np.einsum("rk,rkn->rn", xd[inside], wd[group_of[inside]])
  got = np.asarray(got, np.float64)[inside]
  scale = np.abs(xd[inside]).max(1, keepdims=True) * np.abs(wd).max() * k
  assert np.all(np.abs(got - want) <= np.abs(want) * 2.0 ** -8 + scale * k * 2.0 ** -24)


def test_grouped_matmul_fp8_under_vmap_is_each_call():
  """`jax.vmap` over rows (shared weights) and over weights (rows shared): each element's
  product, within one bf16 rounding (the batched call sums in fp32 in another order)."""
  rng = np.random.default_rng(8)
  sizes = jnp.array([100, 0, 156], jnp.int32)
  xs = [fp8_quantize(jnp.asarray(rng.standard_normal((256, 128)), BF16)) for _ in range(2)]
  ws = [jax_ep.quantize_weights(_weights(rng, 3, 128, 256)) for _ in range(2)]
  x_q, x_s = (jnp.stack(a) for a in zip(*xs))
  w = Fp8Weights(*(jnp.stack(a) for a in zip(*ws)))
  by_rows = jax.vmap(lambda q, s: jax_ep.grouped_matmul_fp8(q, s, ws[0], sizes))(x_q, x_s)
  by_weights = jax.vmap(lambda w: jax_ep.grouped_matmul_fp8(*xs[0], w, sizes))(w)
  def close(got, want):  # a bf16 rounding, or fp32 sums' difference where they cancel
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -14 * np.abs(want).max())
  for i in range(2):
    close(by_rows[i], jax_ep.grouped_matmul_fp8(*xs[i], ws[0], sizes))
    close(by_weights[i], jax_ep.grouped_matmul_fp8(*xs[0], ws[i], sizes))


def test_grouped_matmul_fp8_names_bad_operands():
  x_q, x_scales = fp8_quantize(jnp.ones((128, 256), BF16))
  w = jax_ep.quantize_weights(jnp.ones((2, 256, 128), F32))
  sizes = jnp.array([64, 64], jnp.int32)
  with pytest.raises(TypeError, match="w must be jax_ep.Fp8Weights"):
    jax_ep.grouped_matmul_fp8(x_q, x_scales, jnp.ones((2, 256, 128)), sizes)
  with pytest.raises(TypeError, match="x must be float8_e4m3fn"):
    jax_ep.grouped_matmul_fp8(x_q.astype(BF16), x_scales, w, sizes)
  with pytest.raises(ValueError, match=r"x_scales must be \[rows, K / 128\] = \(128, 2\)"):
    jax_ep.grouped_matmul_fp8(x_q, x_scales[:, :1], w, sizes)
  with pytest.raises(ValueError, match="256 channels"):
    jax_ep.grouped_matmul_fp8(x_q[:, :128], x_scales[:, :1], w, sizes)
  with pytest.raises(ValueError, match="group_sizes must have shape"):
    jax_ep.grouped_matmul_fp8(x_q, x_scales, w, jnp.array([64], jnp.int32))
  with pytest.raises(ValueError, match="sum to at most x.s 128 rows"):
    jax_ep.grouped_matmul_fp8(x_q, x_scales, w, jnp.array([64, 65], jnp.int32))


# ------------------------------------------------------------------------------ the FP8 MLP
def _mlp_case(seed=4, activation="swiglu", alignment=1, hidden=256):
  rng = np.random.default_rng(seed)
  rows, groups, ffn = 640, 4, 384
  sizes, offsets, inside, group_of = _layout([150, 0, 201, 96], alignment, rows)
  x = np.asarray(rng.standard_normal((rows, hidden)), np.float32)
  x[~inside] = np.nan
  gated = activation in ("swiglu", "geglu")
  weights = (_weights(rng, groups, hidden, ffn), _weights(rng, groups, hidden, ffn) if gated
             else None, _weights(rng, groups, ffn, hidden))
  cot = np.asarray(rng.standard_normal((rows, hidden)), np.float32) * inside[:, None]
  return (jnp.asarray(x, BF16), weights, jnp.asarray(sizes), jnp.asarray(offsets), inside,
          jnp.asarray(cot))


def _mlp_loss(fp8, activation, sizes, offsets, cot, **kwargs):
  def loss(x, *weights):
    y = jax_ep.expert_mlp(x, *weights, sizes, group_offsets=offsets, activation=activation,
                          fp8=fp8, **kwargs)
    return jnp.sum(jnp.where(cot != 0, y.astype(F32), 0.0) * cot), y
  return loss


@pytest.mark.parametrize("fp8_weight_grad", [False, True], ids=["bf16_wgrad", "fp8_wgrad"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("alignment", [1, 128])
def test_fp8_expert_mlp_against_float32(activation, alignment, fp8_weight_grad):
  from jax_ep import experts
  x, weights, sizes, offsets, inside, cot = _mlp_case(activation=activation,
                                                      alignment=alignment)
  argnums = tuple(i for i, w in enumerate((x, *weights)) if w is not None)
  grad = lambda fp8: jax.jit(jax.grad(  # noqa: E731
      _mlp_loss(fp8, activation, sizes, offsets, cot), argnums, has_aux=True))
  x_ok = jnp.where(jnp.asarray(inside)[:, None], x, 0).astype(F32)
  with experts.override(fp8_weight_grad=fp8_weight_grad):
    got_grads, got = grad(True)(x, *weights)
  want_grads, want = grad(False)(x_ok, *weights)
  assert got.dtype == BF16
  assert np.all(np.isfinite(np.asarray(got, np.float32)[inside]))
  assert_fp8_close(np.asarray(got, np.float32)[inside], np.asarray(want)[inside], "y")
  names = [n for n, w in zip(("x", "w_gate", "w_up", "w_down"), (x, *weights)) if w is not None]
  for name, g, w in zip(names, got_grads, want_grads):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    if name == "x":
      assert g.dtype == np.float32 and got_grads[0].dtype == BF16
      g, w = g[inside], w[inside]
    assert np.all(np.isfinite(g)), f"d{name} has non-finite entries"
    assert_fp8_close(g, w, f"d{name}")


def test_fp8_weight_gradients_are_fp8_unless_asked_for_bf16():
  """The weight gradients run in FP8 by default (the tokens quantised per 128 per channel), in
  bf16 on the dequantised rows with `override(fp8_weight_grad=False)`; both within the
  recipe's bounds of float32 (`test_fp8_expert_mlp_against_float32`), the input gradient the
  same bits either way. Under `vmap` over the rows (shared weights) each element's FP8 weight
  gradients are its own call's (within a bf16 step: the batched call's float32 sums may run in
  another order on XLA's path)."""
  from jax_ep import experts
  x, weights, sizes, offsets, inside, cot = _mlp_case(seed=9)

  def grads(loss, argnums=(0, 1, 2, 3)):
    return jax.jit(jax.grad(loss, argnums, has_aux=True))
  fp8_grads, _ = grads(_mlp_loss(True, "swiglu", sizes, offsets, cot))(x, *weights)
  with experts.override(fp8_weight_grad=False):
    bf16_grads, _ = grads(_mlp_loss(True, "swiglu", sizes, offsets, cot))(x, *weights)
  with experts.override(fp8_weight_grad=True):
    asked, _ = grads(_mlp_loss(True, "swiglu", sizes, offsets, cot))(x, *weights)
  for g, w in zip(asked, fp8_grads):
    np.testing.assert_array_equal(np.asarray(g, F32), np.asarray(w, F32))
  np.testing.assert_array_equal(np.asarray(fp8_grads[0], F32)[inside],
                                np.asarray(bf16_grads[0], F32)[inside])
  for name, g, w in zip(("w_gate", "w_up", "w_down"), fp8_grads[1:], bf16_grads[1:]):
    g, w = np.asarray(g, F32), np.asarray(w, F32)
    assert not np.array_equal(g, w), name
    assert_fp8_close(g, w, name)
  x2 = jnp.where(jnp.asarray(inside)[:, None], -x, x)
  per_element = jax.jit(jax.vmap(
      lambda x, cot: jax.grad(_mlp_loss(True, "swiglu", sizes, offsets, cot), (1, 2, 3),
                              has_aux=True)(x, *weights)[0]))(jnp.stack([x, x2]),
                                                               jnp.stack([cot, cot * 0.5]))
  wants = [grads(_mlp_loss(True, "swiglu", sizes, offsets, ci), (1, 2, 3))(xi, *weights)[0]
           for xi, ci in ((x, cot), (x2, cot * 0.5))]
  for i, want in enumerate(wants):
    for g, w in zip(per_element, want):
      w = np.asarray(w, F32)
      np.testing.assert_allclose(np.asarray(g[i], F32), w, rtol=2.0 ** -7,
                                 atol=1e-6 * float(np.abs(w).max()))


def test_fp8_weight_gradients_blockwise_off_hopper_are_the_per_group_product(monkeypatch):
  """Off Hopper the FP8 weight gradients multiply each 128-token block once and sum the blocks
  per group (XLA's ragged_dot multiplies every row by every group's mask): the same
  gradients as the per-group product of the same copies, within one bf16 step (the float32
  sums may run in another order), an empty group's zero."""
  from jax_ep.experts import mlp_fp8
  rng = np.random.default_rng(6)
  rows, hidden, ffn = 640, 256, 384
  sizes, offsets, inside, _ = _layout([150, 0, 201, 96], 1, rows)
  x_q, x_scales = fp8_quantize(jnp.asarray(rng.standard_normal((rows, hidden)), BF16))
  h_q, h_scales = fp8_quantize(jnp.asarray(rng.standard_normal((rows, ffn)), BF16))
  d_rows = jnp.asarray(rng.standard_normal((rows, 2 * ffn)), BF16)
  dy = jnp.asarray(rng.standard_normal((rows, hidden)), BF16)
  args = (x_q, x_scales, d_rows, h_q, h_scales, dy, jnp.asarray(sizes), jnp.asarray(offsets))
  taken = []
  monkeypatch.setattr(mlp_fp8, "_blockwise_weight_grad", functools.partial(
      lambda *a, f, **k: taken.append(1) or f(*a, **k), f=mlp_fp8._blockwise_weight_grad))
  grads = lambda: jax.jit(functools.partial(  # noqa: E731
      mlp_fp8._fp8_weight_grads, parts=2, kernels=False))(*args)
  blockwise = grads()
  monkeypatch.setattr(mlp_fp8, "_BLOCKWISE_ELEMENTS", 0)
  per_group = grads()
  assert len(taken) == 2, taken  # both products of the first call, none of the second
  for name, g, w in zip(("w_gate", "w_up", "w_down"), blockwise, per_group):
    g, w = np.asarray(g, F32), np.asarray(w, F32)
    assert np.all(g[1] == 0) and np.all(w[1] == 0), name
    np.testing.assert_allclose(g, w, rtol=2.0 ** -7, atol=1e-6 * float(np.abs(w).max()),
                               err_msg=name)


def test_fp8_rows_given_or_quantised_here_are_the_same_recipe():
  """e4m3 rows with float32 scales, the same rows with UE8M0 exponents (power-of-two scales),
  and bf16 rows quantised by `expert_mlp` itself: the same results, bit for bit; weights passed
  quantised or as masters likewise."""
  x, weights, sizes, offsets, inside, cot = _mlp_case(seed=5)
  base = _mlp_loss(True, "swiglu", sizes, offsets, cot)
  want_grads, want = jax.jit(jax.grad(base, (0, 1, 2, 3), has_aux=True))(x, *weights)
  x_q, x_scales = jax_ep.quantize(x, jax_ep.RowFormat.FP8)
  y_q = jax.jit(lambda q, s, *w: jax_ep.expert_mlp(
      q, *w, sizes, group_offsets=offsets, fp8=True, x_scales=s))(x_q, x_scales, *weights)
  np.testing.assert_array_equal(np.asarray(y_q, np.float32)[inside],
                                np.asarray(want, np.float32)[inside])
  quantised = [jax_ep.quantize_weights(w) for w in weights]
  grads_q, y_w = jax.jit(jax.grad(lambda x, *w: base(x, *w), (0,), has_aux=True))(x, *quantised)
  np.testing.assert_array_equal(np.asarray(y_w, np.float32)[inside],
                                np.asarray(want, np.float32)[inside])
  np.testing.assert_array_equal(np.asarray(grads_q[0]), np.asarray(want_grads[0]))
  # UE8M0: power-of-two scales, packed four exponents to an int32 (H a multiple of 512).
  x, weights, sizes, offsets, inside, _ = _mlp_case(seed=5, hidden=512)
  q2, s2 = fp8_quantize(x, round_scale=True)
  y_pow2 = jax_ep.expert_mlp(q2, *weights, sizes, group_offsets=offsets, fp8=True, x_scales=s2)
  y_ue8m0 = jax_ep.expert_mlp(q2, *weights, sizes, group_offsets=offsets, fp8=True,
                              x_scales=pack_ue8m0(s2))
  np.testing.assert_array_equal(np.asarray(y_pow2, np.float32)[inside],
                                np.asarray(y_ue8m0, np.float32)[inside])


def test_fp8_expert_mlp_under_vmap_and_checkpoint():
  x, weights, sizes, offsets, inside, cot = _mlp_case(seed=6)
  loss = _mlp_loss(True, "swiglu", sizes, offsets, cot)
  grads, y = jax.jit(jax.grad(loss, (0, 1), has_aux=True))(x, *weights)
  ckpt = jax.jit(jax.grad(jax.checkpoint(lambda *a: loss(*a)), (0, 1), has_aux=True))
  grads_c, y_c = ckpt(x, *weights)
  np.testing.assert_array_equal(np.asarray(y_c, np.float32), np.asarray(y, np.float32))
  for a, b in zip(grads_c, grads):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # vmap over two copies of the rows (shared weights): each copy's result is the unbatched one.
  ys = jax.vmap(lambda x: jax_ep.expert_mlp(x, *weights, sizes, group_offsets=offsets,
                                            fp8=True))(jnp.stack([x, x]))
  for i in range(2):
    np.testing.assert_array_equal(np.asarray(ys[i], np.float32)[inside],
                                  np.asarray(y, np.float32)[inside])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_weight_grad", [False, True], ids=["bf16_wgrad", "fp8_wgrad"])
def test_fp8_expert_mlp_on_hopper_under_grad_checkpoint_vmap_and_shard_map(monkeypatch,
                                                                           fp8_weight_grad):
  """The FP8 MLP's Hopper kernels (the gated projections, the FP8 products, the activation
  gradient's pass, the input gradient over both projections; the weight gradients in bf16, or
  in FP8 on the column kernel's copies) as callers run them: the gradient under `jit`, the
  same bits under `jax.checkpoint` and inside `shard_map`, each copy's own under `vmap`, and
  within the recipe's tolerance of XLA's path."""
  from ep_test_base import require_hopper
  from jax_ep import experts
  require_hopper()
  with experts.override(fp8_weight_grad=fp8_weight_grad):
    _fp8_mlp_on_hopper(monkeypatch, bool(fp8_weight_grad))


def _fp8_mlp_on_hopper(monkeypatch, fp8_weight_grad: bool):
  from jax_ep import experts
  from jax_ep.experts import quantize_kernel
  from jax_ep.experts.mlp_fp8 import fp8_mlp_impl
  columns = []
  real_columns = quantize_kernel.quantize_column_blocks
  monkeypatch.setattr(quantize_kernel, "quantize_column_blocks", lambda x, *args: (
      columns.append(x.shape) or real_columns(x, *args)))
  took = []
  real_grad, real_rows = quantize_kernel.activation_grad_blocks, quantize_kernel.quantize_row_blocks
  monkeypatch.setattr(quantize_kernel, "activation_grad_blocks",
                      lambda dh, *args: took.append(dh.shape) or real_grad(dh, *args))
  monkeypatch.setattr(quantize_kernel, "quantize_row_blocks",
                      lambda x: took.append(x.shape) or real_rows(x))
  x, weights, sizes, offsets, inside, cot = _mlp_case(seed=6)
  assert fp8_mlp_impl(640, 4, 256, 384, "swiglu")[0]
  loss = _mlp_loss(True, "swiglu", sizes, offsets, cot)
  grads, y = jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))(x, *weights)
  assert took == [(640, 256), (640, 256), (640, 384)]  # x's and dy's rows, dgate and dup
  # The FP8 weight gradients' copies of x, [dgate | dup], dy and h.
  assert columns == ([(640, 256), (640, 768), (640, 256), (640, 384)] if fp8_weight_grad
                     else [])
  same = lambda a, b: np.testing.assert_array_equal(  # noqa: E731
      np.asarray(a, np.float32), np.asarray(b, np.float32))
  # Rows past the groups (y's and x's gradient's) are unspecified: each program's own.
  same_inside = lambda a, b: same(np.asarray(a)[inside], np.asarray(b)[inside])  # noqa: E731

  def same_result(got_grads, got_y):
    same_inside(got_y, y)
    same_inside(got_grads[0], grads[0])
    jax.tree.map(same, got_grads[1:], grads[1:])

  same_result(*jax.jit(jax.grad(jax.checkpoint(loss), (0, 1, 2, 3), has_aux=True))(
      x, *weights))
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  sharded = jax.shard_map(lambda *a: jax.grad(loss, (0, 1, 2, 3), has_aux=True)(*a),
                          mesh=mesh, in_specs=P(), out_specs=P())
  same_result(*jax.jit(sharded)(x, *weights))
  # vmap over two copies of the rows (shared weights): each copy's gradient is the unbatched.
  dx = jax.jit(jax.vmap(lambda x: jax.grad(loss, has_aux=True)(x, *weights)[0]))(
      jnp.stack([x, x]))
  for i in range(2):
    same(dx[i][inside], grads[0][inside])
  with experts.override(impl="xla"):
    want_grads, want = jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))(x, *weights)
  inside_rows = lambda a: np.asarray(a, np.float32)[inside]  # noqa: E731
  assert_fp8_close(inside_rows(y), inside_rows(want), "y")
  assert_fp8_close(inside_rows(grads[0]), inside_rows(want_grads[0]), "x")
  for name, g, w in zip(("w_gate", "w_up", "w_down"), grads[1:], want_grads[1:]):
    assert_fp8_close(np.asarray(g, np.float32), np.asarray(w, np.float32), name)


@pytest.mark.parametrize("call,match", [
    (lambda x, w, s: jax_ep.expert_mlp(x.astype(jnp.float8_e4m3fn), *w, s, fp8=True),
     "needs its x_scales"),
    (lambda x, w, s: jax_ep.expert_mlp(x, *w, s, fp8=True, x_scales=jnp.ones((640, 2))),
     "x_scales go with float8_e4m3fn x"),
    (lambda x, w, s: jax_ep.expert_mlp(x, *w, s, x_scales=jnp.ones((640, 2))), "pass fp8=True"),
    (lambda x, w, s: jax_ep.expert_mlp(x[:, :200], w[0][:, :200], w[1][:, :200], w[2][:, :, :200],
                                       s, fp8=True), "multiples of 128"),
    (lambda x, w, s: jax_ep.expert_mlp(x, w[0], w[1], w[2][:, :128], s, fp8=True),
     r"w_down must have shape"),
])
def test_fp8_expert_mlp_names_bad_input(call, match):
  x, weights, sizes, *_ = _mlp_case()
  with pytest.raises((ValueError, TypeError), match=match):
    call(x, weights, sizes)


# ----------------------------------------------------------------------------------- the layer
E, K, H, FFN, T = 8, 2, 128, 256, 32


def _layer_inputs(num_ranks, seed=0):
  k_p, k_x, k_c = jax.random.split(jax.random.key(seed), 3)
  params = jax_ep.init_moe_params(k_p, num_experts=E, hidden=H, ffn=FFN, dtype=F32,
                                  shared_ffn=128)
  x = jax.random.normal(k_x, (num_ranks * T, H), F32)
  cot = jax.random.normal(k_c, x.shape, F32)
  return params, x, cot


def _layer_step(group, **options):
  def loss(params, x, cot):
    result = jax_ep.moe_mlp(group, params, x, **options)
    return jnp.sum(result.out.astype(F32) * cot) + jnp.mean(result.aux_loss), result
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("num_ranks", [1, 8])
def test_fp8_layer_against_bf16(new_group, num_ranks):
  group = new_group(num_ranks, num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=BF16)
  params, x, cot = _layer_inputs(num_ranks)
  (_, got), got_grads = _layer_step(group, fp8=True)(params, x, cot)
  (_, want), want_grads = _layer_step(group)(params, x, cot)
  np.testing.assert_array_equal(np.asarray(got.topk_idx), np.asarray(want.topk_idx))
  assert int(np.sum(got.num_dropped)) == int(np.sum(want.num_dropped)) == 0
  assert_fp8_close(got.out, want.out, "out")
  for name in ("router", "w_gate", "w_up", "w_down", "shared_gate", "shared_down"):
    g, w = getattr(got_grads[0], name), getattr(want_grads[0], name)
    assert g.dtype == w.dtype == F32, name  # the masters' dtype
    assert_fp8_close(g, w, f"params.{name}")
  assert_fp8_close(got_grads[1], want_grads[1], "x")


def test_fp8_dispatch_feeds_the_same_recipe(new_group):
  """A group whose dispatch sends e4m3 rows gives the experts the rows they would quantise
  themselves: the same output and gradients, bit for bit."""
  plain = new_group(8, num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=BF16)
  wire = new_group(8, num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=BF16,
                   wire_format=jax_ep.RowFormat.FP8)
  params, x, cot = _layer_inputs(8, seed=1)
  (_, want), want_grads = _layer_step(plain, fp8=True)(params, x, cot)
  (_, got), got_grads = _layer_step(wire, fp8=True)(params, x, cot)
  np.testing.assert_array_equal(np.asarray(got.out, np.float32), np.asarray(want.out, np.float32))
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  with pytest.raises(ValueError, match="fp8=True"):
    _layer_step(wire)(params, x, cot)


def test_fp8_layer_quantises_the_weights_once_per_call(new_group, monkeypatch):
  group = new_group(8, num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=BF16)
  params, x, cot = _layer_inputs(8, seed=2)
  import jax_ep.layer as layer
  calls = []
  real = layer.quantize_weights
  monkeypatch.setattr(layer, "quantize_weights", lambda w: calls.append(w.shape) or real(w))
  (_, split), split_grads = _layer_step(group, fp8=True, micro_batches=2, remat=True)(
      params, x, cot)
  # Inside shard_map: each rank's experts, once each, not once per micro-batch.
  assert calls == [(E // 8, H, FFN), (E // 8, H, FFN), (E // 8, FFN, H)]
  (_, whole), whole_grads = _layer_step(group, fp8=True)(params, x, cot)
  # Each row meets the same e4m3 weights in either split: the output is the same.
  np.testing.assert_allclose(np.asarray(split.out, np.float32), np.asarray(whole.out, np.float32),
                             rtol=1e-2, atol=1e-2)
  for name in ("w_gate", "w_down"):
    assert_fp8_close(getattr(split_grads[0], name), getattr(whole_grads[0], name), name)


def _quantised(params):
  """`params` with the experts' weights as `Fp8Weights`."""
  return params._replace(**{name: jax_ep.quantize_weights(getattr(params, name))
                            for name in ("w_gate", "w_up", "w_down")})


def test_fp8_layer_takes_weights_quantised_once_per_step(new_group, monkeypatch):
  """The experts' weights quantised once (inside the differentiated step) for two calls, as a
  step with gradient accumulation does: each call's output is the one it gives quantising the
  masters itself, the masters' gradients are the sum of both calls', and the layer quantises
  nothing itself."""
  group = new_group(8, num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=BF16)
  params, x, cot = _layer_inputs(8, seed=3)
  _, x2, cot2 = _layer_inputs(8, seed=4)
  batches = ((x, cot), (x2, cot2))

  def loss(params, quantise_once):
    weights = _quantised(params) if quantise_once else params
    total = 0.0
    for tokens, c in batches:
      total = total + jnp.sum(jax_ep.moe_mlp(group, weights, tokens, fp8=True).out.astype(F32)
                              * c)
    return total

  import jax_ep.layer as layer
  calls = []
  real = layer.quantize_weights
  monkeypatch.setattr(layer, "quantize_weights", lambda w: calls.append(w.shape) or real(w))
  got, got_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, True)))(params)
  assert calls == []
  want, want_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, False)))(params)
  assert len(calls) == 6  # three weights, each call
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for name in ("router", "w_gate", "w_up", "w_down", "shared_gate", "shared_down"):
    g, w = getattr(got_grads, name), getattr(want_grads, name)
    assert g.dtype == w.dtype == F32, name
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-2, atol=1e-2 * float(
        np.max(np.abs(np.asarray(w)))), err_msg=f"params.{name}")


def test_fp8_weights_need_the_fp8_layer(new_group):
  group = new_group(1, num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=BF16)
  params, x, _ = _layer_inputs(1)
  with pytest.raises(TypeError, match=r"params.w_gate is Fp8Weights .* with fp8=True"):
    jax_ep.moe_mlp(group, _quantised(params), x)
  shared = params._replace(shared_gate=jax_ep.quantize_weights(params.shared_gate[None]))
  with pytest.raises(TypeError, match="params.shared_gate is Fp8Weights .* only the experts"):
    jax_ep.moe_mlp(group, shared, x, fp8=True)


@pytest.mark.parametrize("options,match", [
    (dict(fp8=True, mode="low_latency"), "fp8=True with mode='low_latency'"),
    (dict(fp8=1), "fp8 must be a bool"),
])
def test_fp8_layer_refuses_what_it_cannot_run(new_group, options, match):
  group = new_group(1, num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=BF16)
  params, x, cot = _layer_inputs(1)
  with pytest.raises((ValueError, TypeError, NotImplementedError), match=match):
    jax_ep.moe_mlp(group, params, x, **options)


def test_fp8_layer_needs_blocks_of_128(new_group):
  group = new_group(1, num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=BF16)
  params = jax_ep.init_moe_params(jax.random.key(0), num_experts=E, hidden=H, ffn=96)
  with pytest.raises(ValueError, match="F = 96"):
    jax_ep.moe_mlp(group, params, jnp.ones((T, H), F32), fp8=True)


@pytest.mark.parametrize("remat", [False, True])
def test_memory_bytes_is_what_the_fp8_layer_keeps(remat):
  """`jax.vjp` of the FP8 layer on the reference backend keeps, the master weights aside,
  `memory_bytes(..., fp8=True)`'s figure per rank: e4m3 rows and scales, bf16 projections and
  the per-call FP8 weights."""
  from test_capacity import _group as capacity_group, _residual_bytes
  r, t = 2, 128
  group = capacity_group(ranks=r, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=t,
                         dtype=BF16)
  params = jax_ep.init_moe_params(jax.random.key(0), num_experts=E, hidden=H, ffn=FFN,
                                  dtype=BF16)
  x = jax.random.normal(jax.random.key(1), (r * t, H)).astype(BF16)
  idx = jax.random.randint(jax.random.key(2), (r * t, K), 0, E, jnp.int32)
  w = jax.random.uniform(jax.random.key(3), (r * t, K))

  def moe(params, x, idx, w):
    return jax_ep.moe_mlp(group, params, x, idx, w, fp8=True, remat=remat).out

  est = group.memory_bytes(ffn=FFN, fp8=True)
  saved, _ = _residual_bytes(moe, params, x, idx, w,
                             exclude=(params.w_gate, params.w_up, params.w_down))
  want = est.expert_activation_bytes_remat if remat else est.expert_activation_bytes
  assert saved == r * want
  if not remat:
    assert want < group.memory_bytes(ffn=FFN).expert_activation_bytes


def test_nnx_module_trains_with_fp8_and_decodes_in_bf16(new_group):
  """`jax_ep.nnx.MoE(fp8=True)`: its training calls are `moe_mlp(..., fp8=True)` on its
  weights (float32 masters), their gradients reach every parameter; a decode call runs the
  experts in the group's dtype."""
  nnx = pytest.importorskip("flax.nnx")
  import jax_ep.nnx  # noqa: F401 - optional: needs flax
  group = new_group(8, num_experts=E, num_topk=K, hidden=H, max_tokens=T, dtype=BF16)
  layer = jax_ep.nnx.MoE(group, ffn=FFN, rngs=nnx.Rngs(0), fp8=True)
  x = jax.random.normal(jax.random.key(3), (8 * T, H), F32)
  want = jax_ep.moe_mlp(group, layer.params, x, fp8=True).out
  np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(want))
  decode = jax_ep.moe_mlp(group, layer.params, x[:8], mode="low_latency").out
  np.testing.assert_array_equal(np.asarray(layer(x[:8], mode="low_latency")), np.asarray(decode))

  with jax.set_mesh(group.mesh):  # the mesh's axes are Explicit: the loss's scalar needs it
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(layer)
  for name in ("router", "w_gate", "w_up", "w_down"):
    g = np.asarray(getattr(grads, name)[...])
    assert g.dtype == np.float32 and np.all(np.isfinite(g)) and np.any(g != 0), name
  with pytest.raises(ValueError, match="ffn=96 must be multiples of 128"):
    jax_ep.nnx.MoE(group, ffn=96, rngs=nnx.Rngs(0), fp8=True)


# ----------------------------------------------------------- the Hopper kernels, interpreted
@pytest.fixture
def fp8_interpreted(monkeypatch):
  """The FP8 MLP on its Hopper kernels in Pallas's Mosaic GPU interpreter (tests/
  test_fp8_kernels.py checks each kernel against its oracle; here they run as `expert_mlp`
  calls them, forward and backward)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax_ep import experts
  from jax_ep.experts import choice, fp8, mlp, mlp_fp8, quantize_kernel
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  monkeypatch.setattr(quantize_kernel, "quantize_weight_blocks", functools.partial(
      quantize_kernel.quantize_weight_blocks, interpret=True))
  real_grad, real_rows = quantize_kernel.activation_grad_blocks, quantize_kernel.quantize_row_blocks
  took = []  # (kernel, shape) of each one-pass kernel of the backward
  monkeypatch.setattr(quantize_kernel, "activation_grad_blocks", lambda dh, *args: (
      took.append(("activation_grad", dh.shape)) or real_grad(dh, *args, interpret=True)))
  monkeypatch.setattr(quantize_kernel, "quantize_row_blocks", lambda x: (
      took.append(("rows", x.shape)) or real_rows(x, interpret=True)))
  real_columns = quantize_kernel.quantize_column_blocks
  monkeypatch.setattr(quantize_kernel, "quantize_column_blocks", lambda x, *args: (
      took.append(("columns", x.shape)) or real_columns(x, *args, interpret=True)))
  monkeypatch.setattr(choice, "mosaic_compile_error", lambda *args: None)
  monkeypatch.setattr(mlp, "fused_compile_error", lambda *args: None)
  monkeypatch.setattr(fp8, "fp8_compile_error", lambda *args: None)
  monkeypatch.setattr(mlp_fp8, "fp8_mlp_compile_error", lambda *args: None)
  # Four CTAs, each taking several of the persistent kernels' items (the interpreter runs every
  # CTA of a grid, idle ones too: a device's 132 would be most of the test's time).
  with plgpu.force_gpu_interpret_mode(), experts.override(kernel_sms=4):
    yield took


@pytest.mark.parametrize("fp8_weight_grad", [False, True], ids=["bf16_wgrad", "fp8_wgrad"])
@pytest.mark.parametrize("activation", ["swiglu"])  # the plain ones: tests/test_fp8_kernels.py
def test_fp8_kernels_as_expert_mlp_runs_them(fp8_interpreted, monkeypatch, activation,
                                             fp8_weight_grad):
  """The fused FP8 path (gated kernel with `h` quantised in its epilogue, the FP8 product, the
  input gradient of both projections as one product; the weight gradients in bf16, or in FP8
  on the column kernel's copies) against the same recipe on the float32 fallback: the same
  rows quantised the same way, so they differ by fp32 summation order and the few codes that
  order flips (relative norm <= 1e-3)."""
  from jax_ep import experts
  from jax_ep.experts.mlp_fp8 import fp8_mlp_impl
  x, weights, sizes, offsets, inside, cot = _mlp_case(seed=7, activation=activation,
                                                      alignment=128)
  argnums = tuple(i for i, w in enumerate((x, *weights)) if w is not None)
  loss = _mlp_loss(True, activation, sizes, offsets, cot)
  with experts.override(fp8_weight_grad=fp8_weight_grad):
    assert fp8_mlp_impl(640, 4, 256, 384, activation)[0]
    got_grads, got = jax.jit(jax.grad(loss, argnums, has_aux=True))(x, *weights)
  # The one-pass kernels: x's quantisation, then the backward's of dy and its activation
  # gradient, then the FP8 weight gradients' copies of x, [dgate | dup], dy and h.
  columns = [("columns", (640, 256)), ("columns", (640, 768)), ("columns", (640, 256)),
             ("columns", (640, 384))]
  assert fp8_interpreted == [("rows", (640, 256)), ("rows", (640, 256)),
                             ("activation_grad", (640, 384))] + (
                                 columns if fp8_weight_grad else [])
  # Off Hopper: the float32 product of the dequantised operands (on Hopper the fallback
  # multiplies them in bf16).
  from jax_ep.experts import choice
  monkeypatch.setattr(choice, "on_hopper", lambda: False)
  with experts.override(fp8_weight_grad=fp8_weight_grad):
    want_grads, want = jax.jit(jax.grad(loss, argnums, has_aux=True))(x, *weights)
  got, want = np.asarray(got, np.float32)[inside], np.asarray(want, np.float32)[inside]
  assert np.all(np.isfinite(got))
  assert _cosine_and_norm(got, want)[1] <= 1e-3, _cosine_and_norm(got, want)
  for i, (g, w) in enumerate(zip(got_grads, want_grads)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    if i == 0:
      g, w = g[inside], w[inside]
    assert np.all(np.isfinite(g)), i
    assert _cosine_and_norm(g, w)[1] <= 1e-3, (i, _cosine_and_norm(g, w))
