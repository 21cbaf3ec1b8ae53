"""The high-throughput dispatch with fp8 rows (`jax_ep.Group(..., wire_format=RowFormat.FP8)`):
its rows and scales against the oracle's closed form (each token quantised once per 128
channels on its own rank, the low-latency pair's rounding), the combine of the dequantised rows
against the unquantised combine within a derived bound, drops, alignment, strict mode, T = 0,
the straight-through gradient under jit / shard_map / vmap / jax.checkpoint, the argument
checks, the registry's choice of the cuda backend and `memory_bytes`.

`FP8DispatchSuite` takes a `Target` (tests/ep_test_base.py): the reference backend here; the
cuda backend's targets subclass it in tests/test_cuda_local.py, test_cuda_peer.py and
test_cuda_network.py (GPU only).
"""

from __future__ import annotations

import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import RowFormat
from jax_ep.backends import registry
from jax_ep.backends.options import CommOptions
from jax_ep._native import ffi as _ffi
from jax_ep.testing import oracle
from ep_test_base import (REFERENCE, BackendSuite, assert_close, make_routing,
                          partial_rounding_bound, random_inputs, used_rows)
from test_defaults import LIMITS, _FakeMesh

FP8_FORMATS = [RowFormat.FP8, RowFormat.FP8_POW2_SCALES, RowFormat.FP8_UE8M0]
E4M3 = np.dtype(jnp.float8_e4m3fn)


class FP8DispatchSuite(BackendSuite):
  """The fp8 high-throughput dispatch on `target`."""

  def inputs(self, num_ranks, num_tokens, hidden, num_topk, num_experts, pattern, seed=0):
    rng = np.random.default_rng(zlib.crc32(repr((num_ranks, num_tokens, hidden, pattern,
                                                  seed)).encode()))
    x = random_inputs(rng, num_ranks, num_tokens, hidden, jnp.bfloat16).copy()
    if hidden >= 256:
      x[..., :128] = 0  # an all-zero block: scale 1
      x[..., 128:256] *= 1e-3  # small values: e4m3 subnormals after scaling
    idx = make_routing(rng, num_ranks, num_tokens, num_topk, num_experts, pattern)
    w = rng.random((num_ranks, num_tokens, num_topk)).astype(np.float32)
    return x, idx, w

  def run(self, group, x, idx, w):
    """Dispatch, then combine of the dequantised rows (the identity expert: the rows inside
    the groups, on Hopper GPUs jax_ep's kernel; test_rows_quantised_by_the_caller checks
    every row's dequantisation against it)."""
    def fn(x, idx, w):
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      rows = jax_ep.dequantize(recv.x, recv.scales, group.dtype, group_sizes=recv.group_sizes,
                               group_offsets=recv.group_offsets)
      return recv, jax_ep.combine(group, rows, handle)
    return self.run_per_rank(group, fn, x, idx, w)

  def exact_fp8(self, group):
    # XLA's f32 -> e4m3 conversion rounds as ml_dtypes on the CPU; a GPU's may differ by one
    # step on ties (as the low-latency suites allow).
    return self.target.fp8_exact or all(d.platform == "cpu" for d in group.mesh.devices.flat)

  def check(self, group, x, idx, w, recv, out):
    """Rows bit-exact (or within one e4m3 step where the target's conversion may differ),
    scales exact, counts and offsets the oracle's; the combine of the dequantised rows within
    the derived bound of the unquantised combine. Returns the oracle's dispatch."""
    fmt = group.wire_format
    expected = oracle.fp8_dispatch(x, idx, group.num_experts, group.capacity,
                                   round_scale=fmt.pow2_scales, ue8m0=fmt.ue8m0,
                                   expert_alignment=group.expert_alignment)
    invalid = oracle.num_invalid(idx, group.num_experts)
    assert recv.x.dtype == E4M3
    scale_dtype = np.int32 if fmt.ue8m0 else np.float32
    assert recv.scales.dtype == scale_dtype
    assert recv.scales.shape[1:] == (group.capacity, group.hidden // (512 if fmt.ue8m0 else 128))
    for d in self.local_ranks(group):
      want = expected[d]
      sizes, offsets = want["group_sizes"], want["group_offsets"]
      np.testing.assert_array_equal(recv.group_sizes[d], sizes, err_msg=f"group_sizes {d}")
      np.testing.assert_array_equal(recv.group_offsets[d], offsets, err_msg=f"offsets {d}")
      assert recv.num_dropped[d] == want["num_dropped"], f"num_dropped on rank {d}"
      assert recv.num_invalid[d] == invalid[d], f"num_invalid on rank {d}"
      got = used_rows(recv.x[d], sizes, offsets).astype(np.float32)
      rows = used_rows(want["recv_x"], sizes, offsets).astype(np.float32)
      if self.exact_fp8(group):
        np.testing.assert_array_equal(got, rows, err_msg=f"recv.x on rank {d}")
      else:
        np.testing.assert_allclose(got, rows, rtol=2**-3, atol=0, err_msg=f"recv.x, rank {d}")
      np.testing.assert_array_equal(used_rows(recv.scales[d], sizes, offsets),
                                    used_rows(want["scales"], sizes, offsets),
                                    err_msg=f"recv.scales on rank {d}")

    # Combine of the dequantised rows. Each dequantised element `q * s` is within half an e4m3
    # step of x: `2^-4 |x|` (3 mantissa bits), or `2^-10 s` among e4m3's subnormals (step
    # 2^-9 of the scale); `dequantize` rounds it once to bf16 (unit roundoff `2^-8`), the fp32
    # accumulation is exact to far below that, and combine rounds once more to bf16. So per
    # element `|out - exact| <= 2^-8 |exact| + sum_k w_k * (2^-8 |q s| + 2^-4 |x| + 2^-10 s)`
    # with `exact` the unquantised combine; against the combine of the exact dequantised rows
    # only the two bf16 roundings remain, and the rounding of each rank's partial sum where
    # the combine's wire is narrower than fp32 (`partial_rounding_bound`: the peer transport's
    # bf16 partials).
    hidden = group.hidden
    q = expected[0]["q"]
    per_channel = np.repeat(expected[0]["token_scales"].astype(np.float64), 128, axis=-1)
    deq = q.astype(np.float64) * per_channel
    step = 2.0**-4 * np.abs(np.asarray(x, np.float64)) + 2.0**-10 * per_channel
    place = lambda rows: [np.asarray(e["recv_x"], np.float64) for e in oracle.dispatch(
        rows, idx, group.num_experts, group.capacity, expert_alignment=group.expert_alignment)]
    combined = lambda rows: oracle.combine(place(rows), expected, w, np.float64)
    exact, of_deq = combined(np.asarray(x, np.float64)), combined(deq)
    bf16_rounding = 2.0**-8 * combined(np.abs(deq)) + partial_rounding_bound(
        group, place(deq), expected, w)
    mine = self.local_mask(group)
    assert_close(out[mine], of_deq[mine], rtol=2**-8, atol=(bf16_rounding + 1e-30)[mine],
                 what="combine of the dequantised rows")
    assert_close(out[mine], exact[mine], rtol=2**-8,
                 atol=(bf16_rounding + combined(step) + 1e-30)[mine],
                 what="combine of the dequantised rows against the unquantised combine")
    return expected

  def roundtrip(self, num_ranks, fmt, *, num_tokens=19, hidden=512, num_topk=4,
                num_experts=16, pattern="uniform", capacity=None, expert_alignment=1,
                strict=False):
    group = self.make_group(num_ranks, num_experts=num_experts, num_topk=num_topk,
                            hidden=hidden, max_tokens=num_tokens, capacity=capacity,
                            expert_alignment=expert_alignment, strict=strict, wire_format=fmt)
    x, idx, w = self.inputs(num_ranks, num_tokens, hidden, num_topk, num_experts, pattern)
    recv, out = self.run(group, x, idx, w)
    return group, recv, self.check(group, x, idx, w, recv, out)

  # ------------------------------------------------------------------ the closed form
  @pytest.mark.ranks("num_ranks", [1, 2, 8])
  @pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
  def test_rows_and_scales(self, num_ranks, fmt):
    self.roundtrip(num_ranks, fmt)

  @pytest.mark.ranks("num_ranks", [1, 2, 8])
  @pytest.mark.parametrize("pattern", ["hot", "duplicates", "invalid", "unused_experts"])
  def test_routing_patterns(self, num_ranks, pattern):
    self.roundtrip(num_ranks, RowFormat.FP8, hidden=256, pattern=pattern)

  def test_deepseek_hidden(self):
    self.roundtrip(self.small_ranks, RowFormat.FP8_UE8M0, num_tokens=7, hidden=7168,
                   num_topk=8, num_experts=256)

  @pytest.mark.ranks("num_ranks", [1, 2, 8])
  def test_drops_are_counted(self, num_ranks):
    _, _, expected = self.roundtrip(num_ranks, RowFormat.FP8, hidden=128, pattern="hot",
                                    capacity=7)
    assert sum(e["num_dropped"] for e in expected) > 0

  @pytest.mark.parametrize("alignment,capacity", [(8, None), (16, 40)])
  def test_expert_alignment(self, alignment, capacity):
    group, recv, expected = self.roundtrip(self.small_ranks, RowFormat.FP8_POW2_SCALES,
                                           hidden=256, expert_alignment=alignment,
                                           capacity=capacity, pattern="hot")
    if capacity is not None:
      assert sum(e["num_dropped"] for e in expected) > 0
    zeroed = jax_ep.zero_padding(recv)
    for d in self.local_ranks(group):
      valid = np.asarray(recv.valid_rows()[d])
      assert (recv.group_offsets[d][recv.group_sizes[d] > 0] % alignment == 0).all()
      np.testing.assert_array_equal(np.asarray(zeroed.scales[d])[~valid], 0)
      np.testing.assert_array_equal(np.asarray(zeroed.x[d]).astype(np.float32)[~valid], 0)

  def test_all_slots_masked(self):
    group, recv, _ = self.roundtrip(self.small_ranks, RowFormat.FP8, hidden=128,
                                    pattern="all_masked")
    for d in self.local_ranks(group):
      assert recv.group_sizes[d].sum() == 0 and recv.num_dropped[d] == 0

  @pytest.mark.parametrize("fmt", [RowFormat.FP8, RowFormat.FP8_UE8M0], ids=lambda f: f.name)
  def test_zero_tokens(self, fmt):
    r, hidden = self.small_ranks, 512
    group = self.make_group(r, num_experts=8, num_topk=2, hidden=hidden, max_tokens=5,
                            wire_format=fmt)
    x = np.zeros((r, 0, hidden), jnp.bfloat16)
    idx, w = np.zeros((r, 0, 2), np.int32), np.zeros((r, 0, 2), np.float32)
    recv, out = self.run(group, x, idx, w)
    assert out.shape == (r, 0, hidden)
    assert recv.x.dtype == E4M3 and recv.x.shape == (r, group.capacity, hidden)
    per = 512 if fmt.ue8m0 else 128
    assert recv.scales.shape == (r, group.capacity, hidden // per)
    assert recv.num_dropped.sum() == 0 and recv.group_sizes.sum() == 0

    def body(x, idx, w):
      def loss(x):
        recv, handle = jax_ep.dispatch(group, x, idx[0], w[0])
        rows = jax_ep.dequantize(recv.x, recv.scales, group.dtype)
        return jnp.sum(jax_ep.combine(group, rows, handle).astype(jnp.float32))
      return jax.grad(loss)(x[0])[None]
    grad = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))(
        *self.shard(group, x, idx, w))
    assert grad.shape == (r, 0, hidden) and grad.dtype == jnp.bfloat16

  @pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
  def test_nan_and_inf_stay_in_their_elements(self, fmt):
    """A NaN is left out of its block's scale and stays NaN in its element; an infinity makes
    its block's scale infinite (the block's finite elements 0, itself NaN): rows and scales
    are the oracle's, and the tokens without them are untouched."""
    r, t, hidden = self.small_ranks, 7, 512
    group = self.make_group(r, num_experts=8, num_topk=2, hidden=hidden, max_tokens=t,
                            wire_format=fmt)
    x, idx, w = self.inputs(r, t, hidden, 2, 8, "uniform")
    x[:, 1, 300] = np.nan
    x[:, 2, 5] = np.inf
    x[:, 3, 260] = -np.inf
    x[:, 3, 400] = np.nan
    recv, _ = self.run(group, x, idx, w)
    expected = oracle.fp8_dispatch(x, idx, 8, group.capacity, round_scale=fmt.pow2_scales,
                                   ue8m0=fmt.ue8m0)
    token_scales = expected[0]["token_scales"]
    assert np.isfinite(token_scales[:, 1]).all() and np.isinf(token_scales[:, 2, 0]).all()
    for d in self.local_ranks(group):
      sizes, offsets = expected[d]["group_sizes"], expected[d]["group_offsets"]
      got = used_rows(recv.x[d], sizes, offsets).astype(np.float32)
      rows = used_rows(expected[d]["recv_x"], sizes, offsets).astype(np.float32)
      np.testing.assert_array_equal(np.isnan(got), np.isnan(rows), err_msg=f"NaNs, rank {d}")
      if self.exact_fp8(group):
        np.testing.assert_array_equal(got, rows, err_msg=f"recv.x on rank {d}")
      else:
        np.testing.assert_allclose(got, rows, rtol=2**-3, atol=0, err_msg=f"recv.x, rank {d}")
      np.testing.assert_array_equal(used_rows(recv.scales[d], sizes, offsets),
                                    used_rows(expected[d]["scales"], sizes, offsets),
                                    err_msg=f"recv.scales on rank {d}")

  def test_strict_reports_drops(self):
    r = self.small_ranks
    group = self.make_group(r, num_experts=8, num_topk=2, hidden=128, max_tokens=19,
                            capacity=3, strict=True, wire_format=RowFormat.FP8)
    x, idx, w = self.inputs(r, 19, 128, 2, 8, "uniform")
    recv, _ = self.run(group, x, idx, w)
    expected = oracle.dispatch(x, idx, 8, 3)
    for d in self.local_ranks(group):
      assert recv.num_dropped[d] == expected[d]["num_dropped"] > 0
    with pytest.raises(jax_ep.CapacityOverflowError, match="did not fit in capacity=3"):
      group.check()
    group.close()

  def test_strict_passes_without_drop(self):
    self.roundtrip(self.small_ranks, RowFormat.FP8, hidden=128, strict=True)

  @pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
  def test_rows_quantised_by_the_caller(self, fmt):
    """e4m3 rows passed with their `x_scales` travel as given: the same result as the rows in
    the group's dtype quantised by dispatch (here every row dequantised, there the rows inside
    the groups)."""
    r, t, hidden = self.small_ranks, 11, 512
    group = self.make_group(r, num_experts=8, num_topk=3, hidden=hidden, max_tokens=t,
                            wire_format=fmt)
    x, idx, w = self.inputs(r, t, hidden, 3, 8, "duplicates")
    q, scales = oracle.fp8_quantize(x, round_scale=fmt.pow2_scales)
    q = q.astype(jnp.float8_e4m3fn)
    if fmt.ue8m0:
      scales = oracle.pack_ue8m0(scales)

    def fn(q, scales, idx, w):
      recv, handle = jax_ep.dispatch(group, q, idx, w, x_scales=scales)
      return recv, jax_ep.combine(group, jax_ep.dequantize(recv.x, recv.scales), handle)
    given, given_out = self.run_per_rank(group, fn, q, scales, idx, w)
    quantised, out = self.run(group, x, idx, w)
    self.check(group, x, idx, w, given, given_out)
    for d in self.local_ranks(group):
      np.testing.assert_array_equal(given_out[d], out[d])

  # ------------------------------------------------------------------ the gradient
  def _dense_grads(self, group, x, idx, w, expert_scale, cot):
    """jax.grad of the dense model in fp32, all ranks at once: each slot's row is the token's
    quantised value (quantisation the identity in the backward), times its expert's scale and
    the slot's weight; the loss is `<out, cot>`."""
    from jax_ep._native.fp8 import fp8_quantize
    fmt = group.wire_format
    num_experts = group.num_experts

    def loss(x, w):
      q, s = fp8_quantize(x, round_scale=fmt.pow2_scales)
      deq = (q.astype(jnp.float32).reshape(*x.shape[:-1], -1, 128) * s[..., None]).reshape(
          x.shape).astype(group.dtype).astype(jnp.float32)
      x32 = x.astype(jnp.float32)
      straight = x32 + jax.lax.stop_gradient(deq - x32)
      valid = (idx >= 0) & (idx < num_experts)
      a = jnp.where(valid, expert_scale[jnp.clip(idx, 0, num_experts - 1)], 0.0)
      out = jnp.einsum("rtk,rth->rth", w * a, straight)
      return jnp.sum(out * cot)
    return jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))

  @pytest.mark.parametrize("transform", ["jit", "checkpoint", "vmap"])
  @pytest.mark.parametrize("fmt", [RowFormat.FP8, RowFormat.FP8_UE8M0], ids=lambda f: f.name)
  def test_gradient_passes_straight_through(self, fmt, transform):
    """jax.grad through dispatch -> dequantize (the rows inside the groups) -> expert (a scale
    per expert) -> combine, in shard_map under jit (with jax.checkpoint, or vmap over two
    batches), against the dense model whose quantisation is the identity in the backward."""
    r, t, hidden, k, e = self.small_ranks, 9, 512, 3, 8
    # A capacity of whole 8-row blocks: on Hopper the dequantisation of the rows inside the
    # groups takes jax_ep's kernel (`quantize_kernel.rows_per_program`).
    capacity = -(-jax_ep.default_capacity(r, t, k, e // r) // 8) * 8
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=hidden, max_tokens=t,
                            wire_format=fmt, capacity=capacity)
    batches = 2 if transform == "vmap" else 1
    rng = np.random.default_rng(21)
    xs, idxs, ws = zip(*(self.inputs(r, t, hidden, k, e, "duplicates", seed=b)
                         for b in range(batches)))
    expert_scale = (1 + 0.25 * rng.standard_normal(e)).astype(np.float32)
    cots = [rng.standard_normal((r, t, hidden)).astype(np.float32) for _ in range(batches)]
    num_local = group.num_local_experts

    def loss(x, idx, w, cot, scale):
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      rows = jax_ep.dequantize(recv.x, recv.scales, group.dtype, group_sizes=recv.group_sizes,
                               group_offsets=recv.group_offsets)
      # Each row's expert, from the groups: row i belongs to expert l where
      # offsets[l] <= i < offsets[l] + sizes[l] (rows outside the groups get scale 0).
      i = jnp.arange(group.capacity)[:, None]
      inside = (i >= recv.group_offsets) & (i < recv.group_offsets + recv.group_sizes)
      mine = jax.lax.dynamic_slice_in_dim(scale, jax.lax.axis_index("ep") * num_local,
                                          num_local)
      row_scale = jnp.sum(jnp.where(inside, mine, 0.0), axis=-1)
      y = (rows.astype(jnp.float32) * row_scale[:, None]).astype(group.dtype)
      out = jax_ep.combine(group, y, handle)
      return jnp.sum(out.astype(jnp.float32) * cot)

    grad = jax.grad(jax.checkpoint(loss) if transform == "checkpoint" else loss,
                    argnums=(0, 2))
    if transform == "vmap":
      grad = jax.vmap(grad, in_axes=(0, 0, 0, 0, None))

    def body(x, idx, w, cot, scale):
      squeeze = (lambda a: a[:, 0]) if transform == "vmap" else (lambda a: a[0])
      dx, dw = grad(squeeze(x), squeeze(idx), squeeze(w), squeeze(cot), scale)
      lift = (lambda a: a[:, None]) if transform == "vmap" else (lambda a: a[None])
      return lift(dx), lift(dw)

    stack = lambda arrays: np.stack(arrays, axis=0) if transform == "vmap" else arrays[0]
    spec = P(None, "ep") if transform == "vmap" else P("ep")
    args = [self.shard(group, stack(a), spec=spec)[0] for a in (xs, idxs, ws, cots)]
    args.append(jnp.asarray(expert_scale))
    dx, dw = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(spec,) * 4 + (P(),),
                                   out_specs=spec))(*args)
    dx, dw = self.to_numpy(dx), self.to_numpy(dw)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == np.float32
    for b in range(batches):
      got_dx = dx[b] if transform == "vmap" else dx
      got_dw = dw[b] if transform == "vmap" else dw
      want_dx, want_dw = (np.asarray(g, np.float64) for g in self._dense_grads(
          group, xs[b], idxs[b], ws[b], expert_scale, cots[b]))
      # The backward rounds to bf16 (unit roundoff 2^-8) the combine's cotangent, the weighted
      # rows' cotangent, its product with the expert's scale and the unweighted combine: four
      # roundings, `4 * 2^-8` of the terms' magnitudes to first order (the dense model's fp32
      # is exact to far below that). The weights' gradient differs by the bf16 roundings of the
      # combine's cotangent and of the expert rows: `2 * 2^-8` of the dot product's terms
      # (`|q s| <= (1 + 2^-4) |x|` plus subnormal steps far below the atol).
      valid = (idxs[b] >= 0) & (idxs[b] < e)
      a = np.where(valid, expert_scale[np.clip(idxs[b], 0, e - 1)], 0.0)
      dx_terms = np.einsum("rtk,rth->rth", np.abs(ws[b] * a), np.abs(cots[b]))
      mine = self.local_mask(group)
      assert_close(got_dx[mine], want_dx[mine], rtol=0, atol=(4.1 * 2**-8 * dx_terms + 1e-6)[mine],
                   what=f"d x, batch {b}")
      x_abs = np.abs(np.asarray(xs[b], np.float64))
      dw_terms = np.einsum("rth,rth->rt", x_abs * 1.07, np.abs(cots[b]))[..., None] * np.abs(a)
      assert_close(got_dw[mine], want_dw[mine], rtol=0, atol=(2.1 * 2**-8 * dw_terms + 1e-6)[mine],
                   what=f"d topk_weights, batch {b}")


class TestReferenceFP8Dispatch(FP8DispatchSuite):
  target = REFERENCE


# ------------------------------------------------------------------------- arguments

def _group(wire_format=RowFormat.FP8, hidden=256, dtype=jnp.bfloat16, **kwargs):
  mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
  return jax_ep.Group(mesh, "ep", num_experts=8, num_topk=2, hidden=hidden,
                      max_tokens_per_rank=4, dtype=dtype, backend="reference",
                      wire_format=wire_format, **kwargs)


def _dispatch(group, x, idx, w, **kwargs):
  def body(x, idx, w, *rest):
    recv, _ = jax_ep.dispatch(group, x, idx, w, **{k: v for k, v in zip(kwargs, rest)})
    return recv.x
  arrays = [x, idx, w, *kwargs.values()]
  return jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))(
      *[jax.device_put(a, jax.NamedSharding(group.mesh, P("ep"))) for a in arrays])


@pytest.mark.parametrize("fmt,hidden,message", [
    (RowFormat.FP8, 192, r"wire_format=RowFormat.FP8 needs hidden to be a multiple of 128 "
                         r"\(one scale per 128 channels\), got hidden=192"),
    (RowFormat.FP8_UE8M0, 384, r"wire_format=RowFormat.FP8_UE8M0 needs hidden to be a "
                               r"multiple of 512 \(four scales per int32\), got hidden=384"),
])
def test_group_needs_its_hidden(fmt, hidden, message):
  with pytest.raises(ValueError, match=r"jax_ep.Group: " + message):
    _group(fmt, hidden)
  with pytest.raises(ValueError, match=r"jax_ep.memory_bytes: " + message):
    jax_ep.memory_bytes(num_ranks=2, num_experts=8, num_topk=2, hidden=hidden,
                        max_tokens_per_rank=4, wire_format=fmt)


def test_wire_format_spellings():
  assert _group("fp8_pow2_scales").wire_format is RowFormat.FP8_POW2_SCALES
  assert _group("FP8").wire_format is RowFormat.FP8
  assert _group(None).wire_format is RowFormat.PLAIN
  assert "wire_format=RowFormat.FP8" in repr(_group())
  assert _group().config.fingerprint()["wire_format"] == "fp8"
  with pytest.raises(ValueError, match=r"jax_ep.Group: wire_format must be one of .*got 'fp9'"):
    _group("fp9")
  with pytest.raises(TypeError, match=r"jax_ep.Group: wire_format must be a jax_ep.RowFormat"):
    _group(True)


def test_plain_group_is_unchanged():
  group = _group(RowFormat.PLAIN)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 256)), jnp.bfloat16)
  idx = jnp.asarray(rng.integers(0, 8, (8, 2)), jnp.int32)
  w = jnp.ones((8, 2), jnp.float32)

  def body(x, idx, w):
    recv, _ = jax_ep.dispatch(group, x, idx, w)
    assert recv.scales is None and len(recv) == 6
    return recv.x
  rows = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))(
      *[jax.device_put(a, jax.NamedSharding(group.mesh, P("ep"))) for a in (x, idx, w)])
  assert rows.dtype == jnp.bfloat16


def _args(group, t=8):
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((t, group.hidden)), jnp.bfloat16)
  return x, jnp.zeros((t, 2), jnp.int32), jnp.ones((t, 2), jnp.float32)


@pytest.mark.parametrize("case,error,message", [
    ("f32 x", TypeError, r"x must have dtype bfloat16 or float8_e4m3fn, got float32"),
    ("e4m3 x without scales", TypeError,
     r"float8_e4m3fn rows x need their scales: pass x_scales \[T, H/128\] float32 = \(4, 2\)"),
    ("scales with bf16 x", TypeError, r"x_scales comes with float8_e4m3fn rows x; x has dtype "
                                      r"bfloat16"),
    ("scales of the wrong dtype", TypeError, r"x_scales must have dtype float32 \(wire_format="
                                             r"RowFormat.FP8: \[T, H/128\] float32\), got int32"),
    ("scales of the wrong shape", ValueError, r"x_scales must have shape \[T, H/128\] float32 = "
                                              r"\(4, 2\) \(T from x, wire_format=RowFormat.FP8\), "
                                              r"got \(4, 1\)"),
    ("scales on a plain group", ValueError, r"x_scales is taken by a group whose wire_format is "
                                            r"an fp8 jax_ep.RowFormat"),
])
def test_bad_arguments_name_what_they_take(case, error, message):
  group = _group(RowFormat.PLAIN if case == "scales on a plain group" else RowFormat.FP8)
  x, idx, w = _args(group)
  e4m3 = x.astype(jnp.float8_e4m3fn)
  scales = jnp.ones((8, 2), jnp.float32)
  call = {
      "f32 x": lambda: _dispatch(group, x.astype(jnp.float32), idx, w),
      "e4m3 x without scales": lambda: _dispatch(group, e4m3, idx, w),
      "scales with bf16 x": lambda: _dispatch(group, x, idx, w, x_scales=scales),
      "scales of the wrong dtype": lambda: _dispatch(group, e4m3, idx, w,
                                                     x_scales=scales.astype(jnp.int32)),
      "scales of the wrong shape": lambda: _dispatch(group, e4m3, idx, w,
                                                     x_scales=scales[:, :1]),
      "scales on a plain group": lambda: _dispatch(group, x, idx, w, x_scales=scales),
  }[case]
  with pytest.raises(error, match=r"jax_ep.dispatch: " + message):
    call()


def test_dequantize():
  rng = np.random.default_rng(3)
  x = rng.standard_normal((3, 5, 1024)).astype(np.float32)
  q, s = oracle.fp8_quantize(x, round_scale=True)
  q = jnp.asarray(q.astype(jnp.float8_e4m3fn))
  want = (np.asarray(q, np.float32).reshape(3, 5, 8, 128) * s[..., None]).reshape(x.shape)
  np.testing.assert_array_equal(jax_ep.dequantize(q, jnp.asarray(s), jnp.float32), want)
  packed = jnp.asarray(oracle.pack_ue8m0(s))
  np.testing.assert_array_equal(jax_ep.dequantize(q, packed, jnp.float32), want)
  assert jax_ep.dequantize(q, packed).dtype == jnp.bfloat16
  # The cotangent passes straight through, in the result's dtype.
  d_q = jax.grad(lambda q: jnp.sum(jax_ep.dequantize(q, packed).astype(jnp.float32) * 3))(q)
  assert d_q.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(d_q, np.float32), 3.0)
  with pytest.raises(TypeError, match=r"jax_ep.dequantize: x must be a float8_e4m3fn array"):
    jax_ep.dequantize(jnp.asarray(x), jnp.asarray(s))
  with pytest.raises(ValueError, match=r"jax_ep.dequantize: scales must have shape "
                                       r"\[..., H/128\] float32 = \(3, 5, 8\)"):
    jax_ep.dequantize(q, jnp.asarray(s[..., :4]))
  with pytest.raises(TypeError, match=r"jax_ep.dequantize: scales must be a float32"):
    jax_ep.dequantize(q, jnp.asarray(s, jnp.bfloat16))
  with pytest.raises(TypeError, match=r"jax_ep.dequantize: dtype must be one of"):
    jax_ep.dequantize(q, jnp.asarray(s), jnp.int8)
  sizes = jnp.asarray([2, 3], jnp.int32)
  with pytest.raises(ValueError, match=r"jax_ep.dequantize: group_sizes asks for the rows of x "
                                       r"\[rows, H\]"):
    jax_ep.dequantize(q, jnp.asarray(s), group_sizes=sizes)
  with pytest.raises(TypeError, match=r"jax_ep.dequantize: group_sizes must be an int32 array"):
    jax_ep.dequantize(q[0], jnp.asarray(s[0]), group_sizes=sizes.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"jax_ep.dequantize: group_offsets must have "
                                       r"group_sizes' shape \(2,\)"):
    jax_ep.dequantize(q[0], jnp.asarray(s[0]), group_sizes=sizes, group_offsets=sizes[:1])
  with pytest.raises(ValueError, match=r"jax_ep.dequantize: group_offsets goes with "):
    jax_ep.dequantize(q[0], jnp.asarray(s[0]), group_offsets=sizes)


def test_dequantize_rows_inside_the_groups():
  """With the groups given, the rows inside them are `dequantize`'s, bit for bit, on every
  path: here XLA's (every row) and jax_ep's kernel interpreted (only the blocks of rows that
  hold rows inside a group are written); the blocks `blocks_inside_groups` flags are those."""
  from jax_ep.backends import primitives
  from jax_ep.experts import layout, quantize_kernel
  rng = np.random.default_rng(5)
  rows, hidden = 96, 384
  x = (rng.standard_normal((rows, hidden)) * 4).astype(np.float32)
  q, s = oracle.fp8_quantize(x, round_scale=False)
  q, s = jnp.asarray(q.astype(jnp.float8_e4m3fn)), jnp.asarray(s)
  sizes, offsets = jnp.asarray([5, 0, 17, 1], jnp.int32), jnp.asarray([0, 8, 16, 80], jnp.int32)
  inside = np.asarray(layout.rows_inside_groups(sizes, offsets, rows))
  want = np.asarray(jax_ep.dequantize(q, s, jnp.bfloat16), np.float32)
  got = jax_ep.dequantize(q, s, jnp.bfloat16, group_sizes=sizes, group_offsets=offsets)
  np.testing.assert_array_equal(np.asarray(got, np.float32)[inside], want[inside])
  block = quantize_kernel.rows_per_program(rows)
  flags = layout.blocks_inside_groups(sizes, offsets, rows, block)
  # 32-row blocks: rows 0-4 and 16-32 in the first two, row 80 in the third.
  assert block == 32 and flags.tolist() == [True, True, True]
  np.testing.assert_array_equal(layout.blocks_inside_groups(sizes, offsets, rows, 8),
                                [1, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0])
  np.testing.assert_array_equal(layout.blocks_inside_groups(jnp.zeros((2,), jnp.int32), None,
                                                            rows, 8), [0] * 12)
  for kernel_offsets in (offsets, None):
    inside = np.asarray(layout.rows_inside_groups(sizes, kernel_offsets, rows))
    by_kernel = quantize_kernel.dequantize_row_blocks(q, s, sizes, kernel_offsets,
                                                      jnp.dtype(jnp.bfloat16), interpret=True)
    np.testing.assert_array_equal(np.asarray(by_kernel, np.float32)[inside], want[inside])
  # The cotangent passes straight through, every row's.
  d_q = jax.grad(lambda q: jnp.sum(primitives.dequantize(
      q, s, jnp.bfloat16, sizes, offsets).astype(jnp.float32)))(q)
  np.testing.assert_array_equal(np.asarray(d_q, np.float32), 1.0)


# ------------------------------------------------------------------------- the cuda backend

def _config(fmt):
  from jax_ep.sizing import check_configuration
  return check_configuration("test", "ep", num_ranks=2, num_experts=16, num_topk=4, hidden=512,
                             max_tokens_per_rank=32, dtype=jnp.bfloat16, capacity=None,
                             buffer_factor=None, expert_alignment=1, wire_format=fmt)


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_cuda_takes_fp8_dispatch_and_auto_picks_it(monkeypatch, fmt):
  """On a (faked) machine where the cuda backend runs the PLAIN group, it runs the fp8 one
  too: its registry entry supports it and 'auto' picks it."""
  real = registry.cuda_support
  support = lambda config, mesh=_FakeMesh([0, 0]): real(
      mesh, config, 24, process_index=0, limits=LIMITS, extension_built=True,
      peer_access=True)
  assert support(_config(RowFormat.PLAIN)) is None
  assert support(_config(fmt)) is None
  assert support(_config(fmt), _FakeMesh([0, 1])) is None  # one process per GPU
  monkeypatch.setattr(registry, "cuda_support", lambda mesh, config, num_sms, **kw: support(
      config, mesh))
  monkeypatch.setattr(registry, "_SAID", set())
  assert registry._resolve_backend("auto", _FakeMesh([0, 0]), _config(fmt),
                                   CommOptions())[0] == "cuda"
  assert registry.BACKENDS["cuda"].supports(_FakeMesh([0, 0]), _config(fmt), CommOptions(),
                                            None) is None


# ------------------------------------------------------------------------- memory

@pytest.mark.parametrize("fmt,row_bytes", [
    (RowFormat.PLAIN, 2 * 1024), (RowFormat.FP8, 1024 + 4 * 8),
    (RowFormat.FP8_POW2_SCALES, 1024 + 4 * 8), (RowFormat.FP8_UE8M0, 1024 + 8)])
def test_memory_bytes_sizes_the_rows_and_scales(fmt, row_bytes):
  sizes = dict(num_ranks=2, num_experts=8, num_topk=2, hidden=1024, max_tokens_per_rank=4)
  est = jax_ep.memory_bytes(**sizes, wire_format=fmt)
  plain = jax_ep.memory_bytes(**sizes)
  assert est.capacity == plain.capacity
  assert est.recv_x_bytes == est.capacity * row_bytes
  assert est.total_bytes - plain.total_bytes == est.recv_x_bytes - plain.recv_x_bytes
  assert jax_ep.memory_bytes(**sizes, wire_format=fmt.value) == est
  group = _group(fmt, hidden=1024)
  assert group.memory_bytes().recv_x_bytes == est.recv_x_bytes


# ------------------------------------------------------------------------- quantize

@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_quantize_is_the_dispatch_rounding(fmt):
  rng = np.random.default_rng(4)
  x = np.array(jnp.asarray(rng.standard_normal((2, 3, 1024)) * 5, jnp.bfloat16))
  x[..., :128] = 0
  q, scales = jax.jit(lambda x: jax_ep.quantize(x, fmt))(jnp.asarray(x))
  want_q, want_s = oracle.fp8_quantize(x, round_scale=fmt.pow2_scales)
  assert q.dtype == E4M3
  np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want_q.astype(np.float32))
  np.testing.assert_array_equal(scales, oracle.pack_ue8m0(want_s) if fmt.ue8m0 else want_s)
  # Straight through: d x = d q, in x's dtype.
  d_x = jax.grad(lambda x: jnp.sum(jax_ep.dequantize(*jax_ep.quantize(x, fmt), jnp.float32)
                                   * 2))(jnp.asarray(x))
  assert d_x.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(d_x, np.float32), 2.0)
  with pytest.raises(ValueError, match=r"jax_ep.quantize: row_format must be an fp8"):
    jax_ep.quantize(jnp.asarray(x), RowFormat.PLAIN)
  with pytest.raises(TypeError, match=r"jax_ep.quantize: x must have dtype bfloat16, float16 "
                                      r"or float32, got int32"):
    jax_ep.quantize(jnp.zeros((2, 128), jnp.int32), fmt)
  with pytest.raises(ValueError, match=r"jax_ep.quantize: row_format=RowFormat.FP8.* needs "
                                       r"hidden to be a multiple of"):
    jax_ep.quantize(jnp.zeros((2, 64), jnp.bfloat16), fmt)


@pytest.mark.parametrize("round_scale", [False, True])
def test_quantize_keeps_nan_and_inf_in_their_elements(round_scale):
  """The one rounding (`jax_ep._native.fp8`; the dispatch suites hold the kernels to it on the
  GPU) against the oracle on values that are not finite: a NaN left out of its block's amax,
  an infinity's block scaled by infinity, `x / scale` saturating at 448."""
  from jax_ep._native.fp8 import fp8_quantize
  x = np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32)
  x[0, 5] = np.nan
  x[1, 130] = np.inf
  x[2, 200], x[2, 300] = -np.inf, np.nan
  q, scales = jax.jit(lambda x: fp8_quantize(x, round_scale=round_scale))(jnp.asarray(x))
  q = np.asarray(q).astype(np.float32)
  want_q, want_s = oracle.fp8_quantize(x, round_scale=round_scale)
  np.testing.assert_array_equal(q, want_q.astype(np.float32))
  np.testing.assert_array_equal(scales, want_s)
  finite_only, _ = oracle.fp8_quantize(np.where(np.isnan(x), 0, x)[:1], round_scale=round_scale)
  # The NaN's block: the scale of its other elements, which quantise as without it.
  assert np.isnan(q[0, 5]) and np.isnan(q[0]).sum() == 1
  np.testing.assert_array_equal(np.delete(q[0], 5), np.delete(finite_only[0], 5))
  # The infinity's block: every element of it NaN (inf / inf) or 0; the other blocks finite.
  assert np.isinf(scales[1, 1]) and np.isnan(q[1, 130]) and (q[1, 128:256][np.arange(128) != 2]
                                                             == 0).all()
  assert np.isfinite(np.delete(q[1], 130)).all() and np.isfinite(scales[1, [0, 2, 3]]).all()
  # A NaN beside an infinity in one row: each in its own block.
  assert np.isinf(scales[2, 1]) and np.isfinite(scales[2, 2])
  # Saturation where the scale underflows to 0 (the oracle and the kernels keep subnormals:
  # an amax below 448 times float32's least subnormal): +-448 where a plain cast gives NaN.
  tiny_q, tiny_s = oracle.fp8_quantize(np.full((1, 128), -1e-44, np.float32))
  assert tiny_s[0, 0] == 0 and (tiny_q.astype(np.float32) == -448).all()
  # Power-of-two scales on the bits, subnormal ones too (UE8M0: their exponent byte is 0).
  sub_q, sub_s = oracle.fp8_quantize(np.full((1, 128), 1e-37, np.float32), round_scale=True)
  assert 0 < sub_s[0, 0] < np.finfo(np.float32).tiny and oracle.pack_ue8m0(
      np.repeat(sub_s, 4, axis=-1))[0, 0] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("transform", ["jit", "vmap", "checkpoint"])
def test_on_the_gpu_dequantize_inside_the_groups_takes_the_kernel(transform):
  """On Hopper `dequantize(..., group_sizes=...)` runs jax_ep's kernel (its name in the compiled
  program) inside shard_map, under jit, vmap or jax.checkpoint with grad: the rows inside the
  groups are those of the whole-buffer dequantisation, bit for bit, NaN past them changes
  nothing, and the cotangent passes straight through."""
  from ep_test_base import require_hopper
  require_hopper()
  rng = np.random.default_rng(8)
  batch, rows, hidden = 2, 4096, 7168
  x = rng.standard_normal((batch, rows, hidden)).astype(np.float32) * 3
  q, s = oracle.fp8_quantize(x, round_scale=False)
  q = q.astype(jnp.float8_e4m3fn)
  sizes = np.asarray([[700, 0, 45, 1], [0, 1000, 3, 333]], np.int32)
  offsets = np.asarray([[0, 768, 768, 1024], [0, 0, 1024, 1152]], np.int32)
  inside = np.stack([np.asarray(jax_ep.experts.layout.rows_inside_groups(
      jnp.asarray(sz), jnp.asarray(of), rows)) for sz, of in zip(sizes, offsets)])
  q = np.where(inside[..., None], q, np.float32(np.nan).astype(jnp.float8_e4m3fn))
  mesh = jax.make_mesh((1,), ("ep",))

  def one(q, s, sizes, offsets):
    out = jax_ep.dequantize(q, s, jnp.bfloat16, group_sizes=sizes, group_offsets=offsets)
    return jnp.where(jnp.asarray(inside_of(sizes, offsets))[:, None], out, 0)

  def inside_of(sizes, offsets):
    return jax_ep.experts.layout.rows_inside_groups(sizes, offsets, rows)

  def loss(q, s, sizes, offsets):
    fn = jax.checkpoint(one) if transform == "checkpoint" else one
    out = jax.vmap(fn)(q, s, sizes, offsets) if transform == "vmap" else fn(
        q[0], s[0], sizes[0], offsets[0])[None]
    return jnp.sum(out.astype(jnp.float32)), out

  def body(q, s, sizes, offsets):
    (_, out), d_q = jax.value_and_grad(loss, has_aux=True)(q, s, sizes, offsets)
    return out, d_q
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))
  args = (jnp.asarray(q), jnp.asarray(s), jnp.asarray(sizes), jnp.asarray(offsets))
  assert "jax_ep_fp8_dequantize_rows" in step.lower(*args).compile().as_text()
  out, d_q = step(*args)
  want = np.asarray(jax_ep.dequantize(jnp.asarray(q), jnp.asarray(s), jnp.bfloat16), np.float32)
  for b in range(out.shape[0]):
    np.testing.assert_array_equal(np.asarray(out[b], np.float32)[inside[b]], want[b][inside[b]])
  d_q = np.asarray(d_q, np.float32)[:out.shape[0]]
  np.testing.assert_array_equal(d_q[inside[:out.shape[0]]], 1.0)


@pytest.mark.parametrize("fmt", [RowFormat.FP8, RowFormat.FP8_UE8M0], ids=lambda f: f.name)
def test_gradient_through_rows_quantised_by_the_caller(fmt):
  """`quantize` then `dispatch(..., x_scales=...)`: the same values and the same gradient as the
  dispatch that quantises (the e4m3 rows' cotangent travels in the group's dtype both ways)."""
  group = _group(fmt, hidden=512)
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16)
  idx = jnp.asarray(rng.integers(0, 8, (8, 2)), jnp.int32)
  w = jnp.asarray(rng.random((8, 2)), jnp.float32)
  cot = jnp.asarray(rng.standard_normal((8, 512)), jnp.float32)

  def body(x, idx, w, cot):
    def loss(x, caller):
      kwargs = {}
      if caller:
        x, kwargs["x_scales"] = jax_ep.quantize(x, fmt)
      recv, handle = jax_ep.dispatch(group, x, idx, w, **kwargs)
      rows = jax_ep.dequantize(recv.x, recv.scales, group.dtype)
      return jnp.sum(jax_ep.combine(group, rows, handle).astype(jnp.float32) * cot)
    return tuple(jax.value_and_grad(loss)(x, caller)[1][None] for caller in (False, True))
  sharded = [jax.device_put(a, jax.NamedSharding(group.mesh, P("ep"))) for a in (x, idx, w, cot)]
  by_dispatch, by_caller = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"),
                                                 out_specs=P("ep")))(*sharded)
  assert by_caller.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(by_caller, np.float32),
                                np.asarray(by_dispatch, np.float32))
  assert np.abs(np.asarray(by_caller, np.float32)).sum() > 0


@pytest.mark.gpu
def test_cuda_takes_fp8_dispatch_on_this_gpu():
  """On a real GPU with the extension: the fp8 group takes the cuda backend, by 'auto' and by
  backend='cuda' (its kernels are checked by the cuda targets of FP8DispatchSuite)."""
  from ep_test_base import rank_mesh, require_gpu
  require_gpu()
  mesh = rank_mesh(1)
  make = lambda **kw: jax_ep.Group(mesh, "ep", num_experts=8, num_topk=2, hidden=512,
                                   max_tokens_per_rank=4, **kw)
  for kwargs in ({"backend": "cuda", "wire_format": RowFormat.FP8},
                 {"wire_format": RowFormat.FP8_UE8M0}):
    group = make(**kwargs)
    assert group.backend_name == "cuda", group.backend_reason
    group.close()


def test_the_layer_takes_an_fp8_group_with_the_fp8_recipe_only():
  """The layer's bf16 experts cannot take e4m3 rows: with an fp8 wire format it asks for
  fp8=True (tests/test_fp8_experts.py runs that) instead of failing inside the experts."""
  group = _group()
  params = jax_ep.init_moe_params(jax.random.key(0), num_experts=group.num_experts,
                                  hidden=group.hidden, ffn=128, dtype=jnp.bfloat16)
  x = jnp.zeros((group.num_ranks * 4, group.hidden), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"jax_ep.moe_mlp: this group's dispatch sends e4m3 rows "
                                       r"\(wire_format=RowFormat.FP8.*fp8=True"):
    jax_ep.moe_mlp(group, params, x)
