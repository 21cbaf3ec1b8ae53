"""Backend-independent tests of the low-latency pair (decode), checked against the numpy oracle.

Subclassed per target (`ep_test_base.Target`): tests/test_reference.py (CPU),
tests/test_cuda_local.py (one rank), tests/test_cuda_peer.py (R ranks under the launcher,
emulated on one GPU or one per GPU), tests/test_cuda_network.py (virtual hosts). On the cuda
backend the rows of a slab past `count` are unspecified, so only the packed rows are compared
there (the reference's are zeros, which it checks: `Target.slab_padding_zeroed`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import RowFormat
from ep_test_base import BackendSuite, host_value, make_routing, random_inputs, rank_mesh
from jax_ep.testing import oracle


GRAPH_WORKER = os.path.join(os.path.dirname(__file__), "mp_workers", "low_latency_graph_worker.py")


def run_graph_worker(mode: str, num_ranks: int):
  """The command-buffer decode worker, in this process's GPU set-up: one rank directly, or
  `num_ranks` ranks sharing GPU 0 under the launcher."""
  env = dict(os.environ)
  cmd = [sys.executable, GRAPH_WORKER, mode]
  if num_ranks > 1:
    cmd = [sys.executable, "-m", "jax_ep.launch", "-n", str(num_ranks), "--share-gpu",
           "--grace", "30", "--timeout", "250", "--", *cmd]
  result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  log = result.stdout + result.stderr
  assert result.returncode == 0 and "60 steps ok" in log, log


class LowLatencyTestBase(BackendSuite):
  """The low-latency pair (decode) and what is built on it, on any target."""

  # A short timeout: a wait that never ends is a test failure with the mailbox's message.
  suite_options = {"low_latency": True, "timeout_s": 20.0}

  # ------------------------------------------------------------------ helpers
  def check_rows(self, group, recv, expected, what="recv_x"):
    """Each expert's packed rows equal the oracle's; past `count`, zeros on the reference."""
    for d in self.local_ranks(group):
      want = expected[d]
      np.testing.assert_array_equal(recv.count[d], want["count"], err_msg=f"count, rank {d}")
      for le, n in enumerate(want["count"]):
        np.testing.assert_array_equal(recv.x[d][le, :n], want["recv_x"][le, :n],
                                      err_msg=f"{what} rows of expert {le}, rank {d}")
        if self.target.slab_padding_zeroed:
          assert not np.any(np.asarray(recv.x[d][le, n:], np.float32)), "padding must be zero"

  @staticmethod
  def inputs(rng, r, t, h, e, k, pattern):
    x = random_inputs(rng, r, t, h, jnp.bfloat16)
    idx = make_routing(rng, r, t, k, e, pattern)
    w = rng.random((r, t, k)).astype(np.float32)
    return x, idx, w

  @staticmethod
  def scaled_expert(recv_x, count, a):
    """The identity expert times a per-expert factor. The rows past `count` are masked before
    any arithmetic (they are unspecified on the cuda backend: a NaN there times a zero
    cotangent would still be NaN in the gradient of `a`)."""
    slab = recv_x.shape[1]
    used = jnp.arange(slab)[None, :, None] < count[:, None, None]
    rows = jnp.where(used, recv_x.astype(jnp.float32), 0.0)
    return (rows * a[:, None, None]).astype(recv_x.dtype)

  # ------------------------------------------------------------------ tests
  @pytest.mark.parametrize("num_tokens", [1, 7, 128])
  @pytest.mark.parametrize("pattern", ["uniform", "one_expert", "unused_experts", "all_masked",
                                       "duplicates", "invalid"])
  def test_roundtrip(self, pattern, num_tokens):
    r, e, k, h = self.small_ranks, 4 * self.small_ranks, 4, 256
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=num_tokens)
    rng = np.random.default_rng(num_tokens)
    x, idx, w = self.inputs(rng, r, num_tokens, h, e, k, pattern)
    slab = r * num_tokens
    eo = random_inputs(rng, r, e // r * slab, h, jnp.bfloat16).reshape(r, e // r, slab, h)

    def fn(x, idx, w, eo):
      recv, handle = jax_ep.low_latency_dispatch(group, x, idx)
      return recv, jax_ep.low_latency_combine(group, eo, handle, w)
    recv, out = self.run_per_rank(group, fn, x, idx, w, eo)
    group.check()
    expected = oracle.low_latency_dispatch(x, idx, e, num_tokens)
    self.check_rows(group, recv, expected)
    invalid = ((idx < -1) | (idx >= e)).sum(axis=(1, 2))
    for d in self.local_ranks(group):
      assert recv.num_dropped[d] == 0
      assert recv.num_invalid[d] == invalid[d]
    want = oracle.low_latency_combine(list(eo), expected, w, np.float64)
    for d in self.local_ranks(group):
      np.testing.assert_allclose(out[d].astype(np.float64), want[d], rtol=1e-2,
                                 atol=1e-2 * (np.abs(want[d]).max() + 1e-30))

  @pytest.mark.parametrize("row_format", [RowFormat.FP8, RowFormat.FP8_POW2_SCALES,
                                          RowFormat.FP8_UE8M0], ids=lambda f: f.name)
  @pytest.mark.parametrize("num_tokens", [1, 128])
  def test_fp8(self, row_format, num_tokens):
    round_scale, use_ue8m0 = row_format.pow2_scales, row_format.ue8m0
    r, e, k, h = self.small_ranks, 4 * self.small_ranks, 4, 1024
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=num_tokens)
    rng = np.random.default_rng(17)
    x, idx, _ = self.inputs(rng, r, num_tokens, h, e, k, "uniform")
    x = x.copy()
    x[..., :128] = 0  # an all-zero block: scale 1
    x[..., 128:256] *= 1e-3
    recv = self.run_per_rank(group, lambda x, idx: jax_ep.low_latency_dispatch(
        group, x, idx, row_format=row_format)[0], x, idx)
    group.check()  # a timed-out wait would leave the counts at zero: say so first
    assert recv.x.dtype == jnp.float8_e4m3fn
    q, scales = oracle.fp8_quantize(x, round_scale=round_scale)
    if round_scale:
      assert set(np.unique(np.log2(scales)) % 1) == {0.0}  # powers of two
    expected_q = oracle.low_latency_dispatch(q, idx, e, num_tokens)
    expected_s = oracle.low_latency_dispatch(scales, idx, e, num_tokens)
    for d in self.local_ranks(group):
      np.testing.assert_array_equal(recv.count[d], expected_q[d]["count"],
                                    err_msg=f"count, rank {d}")
      for le, n in enumerate(expected_q[d]["count"]):
        got = recv.x[d][le, :n].astype(np.float32)
        want = expected_q[d]["recv_x"][le, :n].astype(np.float32)
        if self.target.fp8_exact:
          np.testing.assert_array_equal(got, want, err_msg=f"expert {le}, rank {d}")
        else:  # one e4m3 step (3 mantissa bits) where x / scale sits on a tie
          np.testing.assert_allclose(got, want, rtol=2**-3, atol=0)
        want_s = expected_s[d]["recv_x"][le, :n]
        if use_ue8m0:
          assert recv.scales.dtype == np.int32 and recv.scales.shape[-1] == h // 512
          want_s = oracle.pack_ue8m0(want_s)
        np.testing.assert_array_equal(recv.scales[d][le, :n], want_s)
        if not use_ue8m0:  # dequantised rows are within e4m3's precision of the inputs
          s = recv.scales[d][le, :n, :, None]
          deq = got.reshape(n, h // 128, 128) * s
          src = oracle.low_latency_dispatch(x.astype(np.float32), idx, e, num_tokens)
          src = src[d]["recv_x"][le, :n].reshape(n, h // 128, 128)
          # Half an ulp of e4m3 (3 mantissa bits) relative, or of its subnormals (2^-9 of the
          # scale) absolute.
          assert np.all(np.abs(deq - src) <= 2**-4 * np.abs(src) + 2**-10 * s)

  @pytest.mark.parametrize("row_format", [RowFormat.FP8, RowFormat.FP8_UE8M0],
                           ids=lambda f: f.name)
  def test_fp8_nan_and_inf_stay_in_their_elements(self, row_format):
    """The fp8 rows' rounding (the high-throughput dispatch's too) of values that are not
    finite (a NaN left out of its block's scale, an infinity's block scaled by infinity): rows
    and scales are the oracle's, NaN where it has NaN."""
    r, e, k, h, t = self.small_ranks, 4 * self.small_ranks, 4, 512, 7
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=t)
    x, idx, _ = self.inputs(np.random.default_rng(23), r, t, h, e, k, "uniform")
    x = x.copy()
    x[:, 1, 300] = np.nan
    x[:, 2, 5] = np.inf
    x[:, 3, 260], x[:, 3, 400] = -np.inf, np.nan
    recv = self.run_per_rank(group, lambda x, idx: jax_ep.low_latency_dispatch(
        group, x, idx, row_format=row_format)[0], x, idx)
    group.check()
    q, scales = oracle.fp8_quantize(x, round_scale=row_format.pow2_scales)
    expected_q = oracle.low_latency_dispatch(q, idx, e, t)
    expected_s = oracle.low_latency_dispatch(scales, idx, e, t)
    for d in self.local_ranks(group):
      np.testing.assert_array_equal(recv.count[d], expected_q[d]["count"])
      for le, n in enumerate(expected_q[d]["count"]):
        got = recv.x[d][le, :n].astype(np.float32)
        want = expected_q[d]["recv_x"][le, :n].astype(np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"NaNs, {le} {d}")
        if self.target.fp8_exact:
          np.testing.assert_array_equal(got, want, err_msg=f"expert {le}, rank {d}")
        else:
          np.testing.assert_allclose(got, want, rtol=2**-3, atol=0)
        want_s = expected_s[d]["recv_x"][le, :n]
        if row_format.ue8m0:
          want_s = oracle.pack_ue8m0(want_s)
        np.testing.assert_array_equal(recv.scales[d][le, :n], want_s)

  def test_fp8_options_are_checked(self):
    # How a row format may be spelled: tests/test_row_format.py.
    r = self.small_ranks
    group = self.make_group(r, num_experts=4 * r, num_topk=2, hidden=256, max_tokens=4)
    x = np.zeros((r, 4, 256), jnp.bfloat16)
    idx = np.zeros((r, 4, 2), np.int32)
    for kwargs, message in [(dict(row_format=RowFormat.FP8_UE8M0), "multiple of 512"),
                            (dict(row_format="fp9"), "row_format must be one of")]:
      with pytest.raises(ValueError, match=message):
        self.run_per_rank(group, lambda x, idx, kwargs=kwargs: jax_ep.low_latency_dispatch(
            group, x, idx, **kwargs)[0].count, x, idx)

  def _layer_chain(self, group, xs, idxs, ws, scales, split):
    """`len(idxs)` layers in one program: dispatch, scaled identity expert, combine; with
    `split` each layer's dispatch is sent while the previous combine is outstanding."""
    num_layers = idxs.shape[1]

    def fn(x, idx, w, a):
      if not split:
        def layer(h, inputs):
          i, wt, al = inputs
          recv, handle = jax_ep.low_latency_dispatch(group, h, i)
          eo = self.scaled_expert(recv.x, recv.count, al)
          return jax_ep.low_latency_combine(group, eo, handle, wt), recv.count
        return jax.lax.scan(layer, x, (idx, w, a))
      h, counts, pending = x, [], None
      sent = jax_ep.low_latency_dispatch_send(group, h, idx[0])
      for n in range(num_layers):
        recv, handle = jax_ep.low_latency_dispatch_wait(group, sent)
        counts.append(recv.count)
        eo = self.scaled_expert(recv.x, recv.count, a[n])
        pending = jax_ep.low_latency_combine_send(group, eo, handle)
        h = jax_ep.low_latency_combine_wait(group, pending, w[n])
        if n + 1 < num_layers:
          sent = jax_ep.low_latency_dispatch_send(group, h, idx[n + 1])
      return h, jnp.stack(counts)
    return self.run_per_rank(group, fn, xs, idxs, ws, scales)

  @staticmethod
  def _chain_oracle(xs, idxs, ws, scales, num_experts, t_max, fp8=False):
    """The layer chain in numpy: each layer dispatches the bf16 activations (with `fp8`, their
    e4m3 rows times their per-128-channel scales, as the kernels quantise them: exactly),
    scales each expert's rows, rounds them to bf16 and combines in float64."""
    h = np.asarray(xs, np.float32)
    counts = []
    for n in range(idxs.shape[1]):
      hb = h.astype(jnp.bfloat16)
      if fp8:
        q, s = oracle.fp8_quantize(hb)
        blocks = q.astype(np.float32).reshape(*q.shape[:-1], -1, 128) * s[..., None]
        hb = blocks.reshape(q.shape)
      dispatched = oracle.low_latency_dispatch(hb, idxs[:, n], num_experts, t_max)
      counts.append(np.stack([d["count"] for d in dispatched]))
      eo = [(d["recv_x"].astype(np.float32) * scales[r, n][:, None, None]).astype(jnp.bfloat16)
            for r, d in enumerate(dispatched)]
      h = oracle.low_latency_combine(eo, dispatched, ws[:, n], np.float64)
    return h, np.stack(counts, axis=1)

  @pytest.mark.parametrize("split", [False, True])
  def test_back_to_back_layers(self, split):
    """Six layers in one program (a scan, or the split form with each dispatch sent while the
    previous combine is outstanding); every layer's routing differs."""
    r, e, k, h, t, num_layers = self.small_ranks, 4 * self.small_ranks, 4, 256, 7, 6
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=t)
    rng = np.random.default_rng(5)
    xs = random_inputs(rng, r, t, h, jnp.bfloat16)
    patterns = ["uniform", "duplicates", "one_expert", "invalid", "all_masked", "uniform"]
    idxs = np.stack([make_routing(rng, r, t, k, e, p) for p in patterns], axis=1)
    ws = rng.random((r, num_layers, t, k)).astype(np.float32) / k
    scales = (1 + 0.1 * rng.standard_normal((r, num_layers, e // r))).astype(np.float32)
    out, counts = self._layer_chain(group, xs, idxs, ws, scales, split)
    want, want_counts = self._chain_oracle(xs, idxs, ws, scales, e, t)
    for d in self.local_ranks(group):
      np.testing.assert_array_equal(counts[d], want_counts[d])
      np.testing.assert_allclose(out[d].astype(np.float64), want[d], rtol=3e-2,
                                 atol=3e-2 * (np.abs(want[d]).max() + 1e-30))

  def test_split_matches_fused(self):
    r, e, k, h, t = self.small_ranks, 4 * self.small_ranks, 4, 256, 9
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=t)
    rng = np.random.default_rng(8)
    x, idx, w = self.inputs(rng, r, t, h, e, k, "duplicates")

    def fused(x, idx, w):
      recv, handle = jax_ep.low_latency_dispatch(group, x, idx, row_format=RowFormat.FP8)
      eo = self.scaled_expert(recv.x.astype(jnp.bfloat16), recv.count,
                              jnp.ones((e // r,), jnp.float32))
      return recv, jax_ep.low_latency_combine(group, eo, handle, w)

    def split(x, idx, w):
      recv, handle = jax_ep.low_latency_dispatch_wait(
          group, jax_ep.low_latency_dispatch_send(group, x, idx, row_format=RowFormat.FP8))
      eo = self.scaled_expert(recv.x.astype(jnp.bfloat16), recv.count,
                              jnp.ones((e // r,), jnp.float32))
      return recv, jax_ep.low_latency_combine_wait(
          group, jax_ep.low_latency_combine_send(group, eo, handle), w)
    a_recv, a_out = self.run_per_rank(group, fused, x, idx, w)
    b_recv, b_out = self.run_per_rank(group, split, x, idx, w)
    for d in self.local_ranks(group):
      np.testing.assert_array_equal(a_recv.count[d], b_recv.count[d])
      for le, n in enumerate(a_recv.count[d]):
        np.testing.assert_array_equal(a_recv.x[d][le, :n].astype(np.float32),
                                      b_recv.x[d][le, :n].astype(np.float32))
        np.testing.assert_array_equal(a_recv.scales[d][le, :n], b_recv.scales[d][le, :n])
      np.testing.assert_array_equal(a_out[d].astype(np.float32), b_out[d].astype(np.float32))

  def test_gradients(self):
    """d/dx, d/d(expert_out) and d/d(topk_weights) against the closed form of
    out[t] = sum_k w[t, k] * a[e_k] * x[t] (identity expert scaled per expert)."""
    r, e, k, h, t = self.small_ranks, 4 * self.small_ranks, 4, 256, 6
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=t)
    rng = np.random.default_rng(3)
    x, idx, w = self.inputs(rng, r, t, h, e, k, "duplicates")
    idx[:, 0, 1] = -1  # a slot that selects nothing
    a = (1 + 0.2 * rng.standard_normal((r, e // r))).astype(np.float32)
    g = random_inputs(rng, r, t, h, jnp.bfloat16)

    def loss(x, w, a, idx, g):
      recv, handle = jax_ep.low_latency_dispatch(group, x, idx)
      eo = self.scaled_expert(recv.x, recv.count, a)
      out = jax_ep.low_latency_combine(group, eo, handle, w)
      return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

    def fn(x, w, a, idx, g):
      return jax.grad(loss, argnums=(0, 1, 2))(x, w, a, idx, g)
    dx, dw, da = self.run_per_rank(group, fn, x, w, a, idx, g)
    xf, gf = x.astype(np.float64), g.astype(np.float64)
    all_a = a.reshape(-1)  # global expert e has factor a[e // L, e % L]
    valid = (idx >= 0) & (idx < e)
    ae = np.where(valid, all_a[np.clip(idx, 0, e - 1)], 0.0)  # [R, T, K]
    want_dx = np.einsum("rtk,rtk,rth->rth", w, ae, gf)
    xg = np.einsum("rth,rth->rt", xf, gf)
    want_dw = np.where(valid, ae * xg[..., None], 0.0)
    # d a[e] = sum over the slots that chose e of w * <x, g>: every rank's tokens.
    slot_terms = np.where(valid, w * xg[..., None], 0.0)
    want_da = np.bincount(np.where(valid, idx, 0).reshape(-1), weights=slot_terms.reshape(-1),
                          minlength=e).reshape(r, e // r)
    for d in self.local_ranks(group):
      np.testing.assert_allclose(dx[d].astype(np.float64), want_dx[d], rtol=2e-2,
                                 atol=2e-2 * np.abs(want_dx[d]).max())
      np.testing.assert_allclose(dw[d], want_dw[d], rtol=2e-2,
                                 atol=2e-2 * np.abs(want_dw[d]).max())
      np.testing.assert_allclose(da[d], want_da[d], rtol=2e-2,
                                 atol=2e-2 * np.abs(want_da).max(),
                                 err_msg=f"gradient of the experts' scales, rank {d}")

  def test_vmap_matches_per_element(self):
    r, e, k, h, t = self.small_ranks, 4 * self.small_ranks, 4, 256, 5
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=t)
    rng = np.random.default_rng(11)
    xs = np.stack([random_inputs(rng, r, t, h, jnp.bfloat16) for _ in range(2)], axis=1)
    idxs = np.stack([make_routing(rng, r, t, k, e, "uniform") for _ in range(2)], axis=1)
    ws = rng.random((r, 2, t, k)).astype(np.float32)

    def roundtrip(x, idx, w):
      recv, handle = jax_ep.low_latency_dispatch(group, x, idx)
      eo = self.scaled_expert(recv.x, recv.count, jnp.ones((e // r,), jnp.float32))
      return jax_ep.low_latency_combine(group, eo, handle, w)
    batched = self.run_per_rank(group, jax.vmap(roundtrip), xs, idxs, ws)
    for b in range(2):
      single = self.run_per_rank(group, roundtrip, xs[:, b], idxs[:, b], ws[:, b])
      for d in self.local_ranks(group):
        np.testing.assert_array_equal(batched[d, b].astype(np.float32),
                                      single[d].astype(np.float32))

  def test_moe_layer_low_latency_matches_high_throughput(self):
    """`moe_mlp_per_shard(mode="low_latency")` (the experts on the decode slabs) against the
    high-throughput layer on the same tokens, router and experts."""
    r, e, k, h, f, t = self.small_ranks, 4 * self.small_ranks, 4, 128, 64, 12
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=t)
    params = jax_ep.init_moe_params(jax.random.key(0), num_experts=e, hidden=h, ffn=f,
                                    dtype=jnp.bfloat16)
    per_rank = lambda w: np.asarray(w).reshape(r, e // r, *w.shape[1:])  # experts split
    router = np.broadcast_to(np.asarray(params.router), (r, *params.router.shape))
    rng = np.random.default_rng(4)
    x = random_inputs(rng, r, t, h, jnp.bfloat16)

    def fn(x, router, w_gate, w_up, w_down):
      p = params._replace(router=router, w_gate=w_gate, w_up=w_up, w_down=w_down)
      ht = jax_ep.moe_mlp_per_shard(group, p, x).out
      ll = jax_ep.moe_mlp_per_shard(group, p, x, mode="low_latency").out
      return ht, ll
    ht, ll = self.run_per_rank(group, fn, x, router, per_rank(params.w_gate),
                               per_rank(params.w_up), per_rank(params.w_down))
    for d in self.local_ranks(group):
      scale = np.abs(ht[d].astype(np.float32)).max()
      assert scale > 0
      np.testing.assert_allclose(ll[d].astype(np.float32), ht[d].astype(np.float32),
                                 rtol=0, atol=3e-2 * scale)


class CudaLowLatencyTests(LowLatencyTestBase):
  """What only the kernels have: the split ops as separate custom calls, the one-send rule,
  the buffers a group must be created with."""

  def test_kernels_need_no_local_memory(self):
    """A kernel that needs local memory can, at its first launch, wait for a GPU shared under
    MPS to drain, peers' spinning waits included: none of the low-latency kernels may."""
    r = self.small_ranks
    self.make_group(r, num_experts=4 * r, num_topk=2, hidden=256, max_tokens=4)  # preloads
    assert jax_ep._native.ffi.extension().low_latency_local_bytes() == 0

  def test_needs_low_latency_buffers(self):
    r = self.small_ranks
    group = self.closing(jax_ep.Group(rank_mesh(r), "ep", num_experts=4 * r, num_topk=2,
                                      hidden=256, max_tokens_per_rank=4, backend=self.backend))
    x = np.zeros((r, 4, 256), jnp.bfloat16)
    idx = np.zeros((r, 4, 2), np.int32)
    with pytest.raises(ValueError, match="low_latency=True"):
      self.run_per_rank(group, lambda x, idx: jax_ep.low_latency_dispatch(group, x, idx)[0].count,
                        x, idx)
    group.close()
    est = jax_ep.memory_bytes(num_ranks=r, num_experts=4 * r, num_topk=2, hidden=256,
                              max_tokens_per_rank=4, backend="cuda", low_latency=True)
    assert est.low_latency_buffer_bytes >= 2 * 4 * r * 4 * 256 * 2  # two sets of L*R*T rows

  def test_independent_work_runs_between_send_and_wait(self):
    """The split dispatch is two custom calls; a matmul that depends on neither runs between
    them in the compiled program (placed there with optimization barriers, the documented
    way), and the results are exact."""
    r, e, k, h, t = self.small_ranks, 4 * self.small_ranks, 4, 256, 16
    group = self.make_group(r, num_experts=e, num_topk=k, hidden=h, max_tokens=t)
    rng = np.random.default_rng(2)
    x, idx, _ = self.inputs(rng, r, t, h, e, k, "uniform")
    m = rng.standard_normal((r, 512, 512)).astype(np.float32)

    def body(x, idx, m):
      sent = jax_ep.low_latency_dispatch_send(group, x[0], idx[0])
      # The matmul reads nothing the dispatch writes; the barriers pin it after the send and
      # before the wait (XLA's scheduler would otherwise be free to run it anywhere).
      sent, a = jax.lax.optimization_barrier((sent, m[0]))
      other = jnp.matmul(a, a, precision="highest")
      sent, other = jax.lax.optimization_barrier((sent, other))
      recv, _ = jax_ep.low_latency_dispatch_wait(group, sent)
      return recv.x[None], recv.count[None], other[None]
    mapped = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))
    args = self.shard(group, x, idx, m)
    text = mapped.lower(*args).compile().as_text()
    send = text.find('custom_call_target="jax_ep_low_latency_dispatch_send"')
    wait = text.find('custom_call_target="jax_ep_low_latency_dispatch_wait"')
    assert 0 <= send < wait, "send and wait must be separate custom calls, in that order"
    between = text[send:wait]
    assert "gemm" in between or " dot(" in between, (
        "the matmul is not scheduled between send and wait:\n" + between[:4000])
    recv_x, count, other = jax.tree.map(host_value, mapped(*args))
    expected = oracle.low_latency_dispatch(x, idx, e, t)
    for d in self.local_ranks(group):
      np.testing.assert_array_equal(count[d], expected[d]["count"])
      for le, n in enumerate(expected[d]["count"]):
        np.testing.assert_array_equal(recv_x[d][le, :n], expected[d]["recv_x"][le, :n])
      np.testing.assert_allclose(other[d], m[d] @ m[d], rtol=1e-2, atol=1e-2)

  def test_second_send_before_wait_is_an_error(self):
    r = self.small_ranks
    group = self.make_group(r, num_experts=4 * r, num_topk=2, hidden=256, max_tokens=4,
                            timeout_s=5.0)
    x = np.ones((r, 4, 256), jnp.bfloat16)
    idx = np.zeros((r, 4, 2), np.int32)

    def body(x, idx):
      first = jax_ep.low_latency_dispatch_send(group, x, idx)
      second = jax_ep.low_latency_dispatch_send(group, x + 1, idx)
      recv, _ = jax_ep.low_latency_dispatch_wait(group, second)
      del first
      return recv.count
    try:
      self.run_per_rank(group, body, x, idx)
    except Exception:  # noqa: BLE001 - a later op of the failed group may raise too
      pass
    with pytest.raises(TimeoutError, match="before the previous call's wait"):
      group.check()
    group.close()  # already raised by check()
