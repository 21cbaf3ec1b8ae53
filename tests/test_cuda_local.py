"""The shared suite on the cuda backend at one rank (the local layout / dispatch / combine kernels).

Marked `gpu`: skipped where no CUDA GPU or no built extension is present (see conftest.py).
Run on a GPU: `python -m pytest tests/test_cuda_local.py -v`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import RowFormat
from ep_test_base import (CUDA_LOCAL, EPTestBase, assert_close, make_routing, random_inputs,
                          tolerance, used_rows)
from low_latency_test_base import CudaLowLatencyTests, run_graph_worker
from jax_ep.testing import oracle
from test_fp8_dispatch import FP8_FORMATS, FP8DispatchSuite

pytestmark = pytest.mark.gpu


class TestCudaLocalLowLatency(CudaLowLatencyTests):
  target = CUDA_LOCAL

  @pytest.mark.parametrize("mode", ["bf16", "fp8"])
  def test_decode_step_in_command_buffers(self, mode):
    run_graph_worker(mode, 1)


class TestCudaLocalFP8Dispatch(FP8DispatchSuite):
  """The fp8 dispatch's kernel at one rank (jax_ep_local_dispatch_fp8): rows and scales
  bit-exact against the closed form, the straight-through gradient."""
  target = CUDA_LOCAL

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
  @pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
  def test_activation_dtypes(self, dtype, fmt):
    """Activations in float32 and float16 (a 128-channel block spans 32 and 16 lanes of the
    quantising warp): the rows and scales of the closed form."""
    group = self.make_group(1, num_experts=16, num_topk=4, hidden=1024, max_tokens=37,
                            dtype=dtype, wire_format=fmt)
    rng = np.random.default_rng(9)
    x = random_inputs(rng, 1, 37, 1024, dtype).copy()
    x[..., :128] = 0
    idx = make_routing(rng, 1, 37, 4, 16, "duplicates")
    w = rng.random((1, 37, 4)).astype(np.float32)

    def fn(x, idx, w):
      recv, _ = jax_ep.dispatch(group, x, idx, w)
      return recv
    recv = self.run_per_rank(group, fn, x, idx, w)
    want = oracle.fp8_dispatch(x, idx, 16, group.capacity, round_scale=fmt.pow2_scales,
                               ue8m0=fmt.ue8m0)[0]
    sizes = want["group_sizes"]
    np.testing.assert_array_equal(recv.group_sizes[0], sizes)
    np.testing.assert_array_equal(used_rows(recv.x[0], sizes).astype(np.float32),
                                  used_rows(want["recv_x"], sizes).astype(np.float32))
    np.testing.assert_array_equal(used_rows(recv.scales[0], sizes),
                                  used_rows(want["scales"], sizes))

  @pytest.mark.parametrize("num_tokens", [1, 989])
  def test_vmap_runs_one_launch_per_batch(self, num_tokens):
    """vmap over three routings: the local kernels take the batch in one launch, each element
    at its own offset in the rows and scales."""
    fmt = RowFormat.FP8_UE8M0
    group = self.make_group(1, num_experts=64, num_topk=8, hidden=2048,
                            max_tokens=num_tokens, wire_format=fmt)
    rng = np.random.default_rng(10)
    patterns = ("hot", "invalid", "uniform")
    xs = np.stack([random_inputs(rng, 1, num_tokens, 2048, jnp.bfloat16) for _ in patterns], 1)
    idxs = np.stack([make_routing(rng, 1, num_tokens, 8, 64, p) for p in patterns], 1)
    ws = rng.random((1, 3, num_tokens, 8)).astype(np.float32)

    def fn(x, idx, w):
      recv, _ = jax_ep.dispatch(group, x, idx, w)
      return recv.x, recv.scales, recv.group_sizes
    rows, scales, sizes = self.run_per_rank(group, jax.vmap(fn), xs, idxs, ws)
    for b in range(len(patterns)):
      want = oracle.fp8_dispatch(xs[:, b], idxs[:, b], 64, group.capacity, round_scale=True,
                                 ue8m0=True)[0]
      g = want["group_sizes"]
      np.testing.assert_array_equal(sizes[0, b], g)
      np.testing.assert_array_equal(used_rows(rows[0, b], g).astype(np.float32),
                                    used_rows(want["recv_x"], g).astype(np.float32))
      np.testing.assert_array_equal(used_rows(scales[0, b], g), used_rows(want["scales"], g))


def test_fp8_dispatch_handler_names_what_it_takes():
  """The handler's own checks (the public API checks first, so these guard direct calls): the
  scales of given rows, the hidden size of a format, the format attribute."""
  from jax_ep.backends import cuda_ops
  from jax_ep.config import EPConfig
  from ep_test_base import require_gpu
  require_gpu()
  cfg = EPConfig("ep", 1, 8, 2, 512, 4, np.dtype(jnp.bfloat16), 8, wire_format=RowFormat.FP8)
  layout, *_ = jax.jit(lambda i: cuda_ops.local_layout(cfg, i))(jnp.zeros((4, 2), jnp.int32))
  q = jnp.zeros((4, 512), jnp.float8_e4m3fn)
  with pytest.raises(Exception, match=r"jax_ep_local_dispatch_fp8: x_scales must have shape "
                                      r"\[T, H/128\] float32 = \[4, 4\], got shape \[4, 3\]"):
    jax.block_until_ready(jax.jit(lambda q, s: cuda_ops.local_dispatch_fp8(cfg, q, s, layout))(
        q, jnp.ones((4, 3), jnp.float32)))
  with pytest.raises(Exception, match=r"jax_ep_local_dispatch_fp8: x must be float8_e4m3fn rows "
                                      r"when given with x_scales"):
    jax.block_until_ready(jax.jit(lambda x, s: cuda_ops.local_dispatch_fp8(cfg, x, s, layout))(
        jnp.zeros((4, 512), jnp.bfloat16), jnp.ones((4, 4), jnp.float32)))
  odd = EPConfig("ep", 1, 8, 2, 384, 4, np.dtype(jnp.bfloat16), 8,
                 wire_format=RowFormat.FP8_UE8M0)
  with pytest.raises(Exception, match=r"jax_ep_local_dispatch_fp8: x hidden size H is 384, "
                                      r"expected a multiple of 512"):
    jax.block_until_ready(jax.jit(lambda x: cuda_ops.local_dispatch_fp8(odd, x, None, layout))(
        jnp.zeros((4, 384), jnp.bfloat16)))


class TestCudaLocalOnCommStream(EPTestBase):
  """The shared suite with the ops on XLA's additional stream 1 (`comm_stream=1`), beside the
  compute stream: the same results under jit, grad, vmap, checkpoint and scan."""
  target = dataclasses.replace(CUDA_LOCAL, name="cuda backend at one rank, comm_stream=1",
                               group_options={**CUDA_LOCAL.group_options, "comm_stream": 1})


class TestCudaLocalOnOwnStream(EPTestBase):
  """The shared suite with the ops on jax_ep's own stream (`comm_stream="jax_ep"`), each joined
  after it: the same results under jit, grad, vmap, checkpoint and scan."""
  target = dataclasses.replace(CUDA_LOCAL, name="cuda backend at one rank, own stream",
                               group_options={**CUDA_LOCAL.group_options,
                                              "comm_stream": "jax_ep"})


class TestCudaLocal(EPTestBase):
  target = CUDA_LOCAL

  @pytest.mark.parametrize("num_tokens", [1, 19, 99, 989, 4096])
  @pytest.mark.parametrize("num_experts,num_topk", [(1, 1), (256, 8), (1024, 4), (33, 5)])
  def test_sizes(self, num_tokens, num_experts, num_topk):
    self._roundtrip(1, num_tokens, 1024, num_topk, num_experts, "uniform", jnp.bfloat16)

  @pytest.mark.parametrize("num_tokens", [19, 989, 4096])
  @pytest.mark.parametrize("num_experts,num_topk", [(256, 8), (1024, 4), (33, 5)])
  @pytest.mark.parametrize("alignment", [64, 128])
  def test_sizes_with_expert_alignment(self, num_tokens, num_experts, num_topk, alignment):
    # The one-launch and the chunked layout, each expert's first row a multiple of alignment.
    self._roundtrip(1, num_tokens, 256, num_topk, num_experts, "uniform", jnp.bfloat16,
                    expert_alignment=alignment)

  @pytest.mark.parametrize("hidden", [8, 136, 7168])
  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
  def test_hidden_sizes(self, hidden, dtype):
    self._roundtrip(1, 37, hidden, 8, 64, "invalid", dtype)

  # Few tokens with wide rows: the kernels split each row into parts so that the GPU fills
  # (RowSplits; H=2048 is 256 16-byte vectors in bf16, 512 in f32). Drops, duplicate experts,
  # invalid ids, the unweighted form and vmap on that path.
  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
  @pytest.mark.parametrize("pattern,capacity,weighted", [
      ("hot", 40, True), ("duplicates", None, False), ("invalid", None, True)])
  def test_rows_split_into_parts(self, dtype, pattern, capacity, weighted):
    _, _, expected = self._roundtrip(1, 19, 2048, 8, 64, pattern, dtype, capacity=capacity,
                                     weighted=weighted)
    if capacity is not None:
      assert expected[0]["num_dropped"] > 0

  # Decode sizes (few tokens, H=7168): the combine runs CombineVectorKernel, built per top-k
  # (1, 2, 4, 6 and 8; 3 takes CombineKernel); dropped slots and invalid ids are no row.
  @pytest.mark.parametrize("num_topk", [1, 2, 3, 4, 6, 8])
  @pytest.mark.parametrize("pattern,capacity", [("hot", 12), ("invalid", None)])
  def test_decode_sizes_each_topk(self, num_topk, pattern, capacity):
    self._roundtrip(1, 5, 7168, num_topk, 16, pattern, jnp.bfloat16, capacity=capacity)

  # vmap: one launch over the batch, each element at its own offset in the expert rows (at
  # H=7168 the combine runs CombineVectorKernel with its batch offset, top-k 8 and 6).
  @pytest.mark.parametrize("hidden,num_tokens,num_topk,capacity", [
      (2048, 19, 8, 60), (7168, 5, 8, 12), (7168, 5, 6, 12)])
  def test_rows_split_into_parts_under_vmap(self, hidden, num_tokens, num_topk, capacity):
    group = self.make_group(1, num_experts=16, num_topk=num_topk, hidden=hidden,
                            max_tokens=num_tokens, dtype=jnp.float32, capacity=capacity)
    patterns = ("hot", "invalid", "uniform")
    xs, idxs, ws, eos = self._batched_inputs(group, np.random.default_rng(5), num_tokens,
                                             patterns)
    recv, out = self.run_per_rank(group, jax.vmap(self._dispatch_combine_fn(group)), xs, idxs,
                                  ws, eos)
    for b in range(len(patterns)):
      expected = self.check_dispatch(group, xs[:, b], idxs[:, b],
                                     jax.tree.map(lambda a: a[:, b], recv))
      want = oracle.combine(list(eos[:, b]), expected, ws[:, b], np.float64)
      assert_close(out[:, b], want, rtol=1e-5, atol=1e-5)

  def test_large_token_count(self):
    # T = 65536: row indices and slot counts past 16 bits; checked on the device-side counts.
    group = self.make_group(1, num_experts=256, num_topk=8, hidden=128, max_tokens=65536,
                            dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    idx = make_routing(rng, 1, 65536, 8, 256, "uniform")
    x = random_inputs(rng, 1, 65536, 128, jnp.bfloat16)
    w = rng.random((1, 65536, 8)).astype(np.float32)

    def fn(x, idx, w):
      recv, handle = jax_ep.dispatch(group, x, idx, w)
      return recv.group_sizes, recv.num_dropped, jax_ep.combine(group, recv.x, handle)
    sizes, dropped, out = self.run_per_rank(group, fn, x, idx, w)
    np.testing.assert_array_equal(sizes[0], np.bincount(idx.reshape(-1), minlength=256))
    assert dropped[0] == 0
    # combine(dispatch(x)) with weights w is x * sum_k w, since every slot keeps its row.
    want = x[0].astype(np.float32) * w[0].sum(-1, keepdims=True)
    np.testing.assert_allclose(out[0].astype(np.float32), want, rtol=2e-2, atol=2e-2)

  def test_hidden_not_multiple_of_8_is_rejected(self):
    # At creation, naming the limit (the kernels move rows as 16-byte vectors).
    with pytest.raises(ValueError, match="hidden=12 is not a multiple of 8"):
      self.make_group(1, num_experts=8, num_topk=2, hidden=12, max_tokens=4, dtype=jnp.float32)

  @pytest.mark.parametrize("command_buffers", [True, False])
  def test_command_buffers_on_and_off(self, command_buffers):
    group = self.make_group(1, num_experts=64, num_topk=4, hidden=256, max_tokens=128,
                            dtype=jnp.bfloat16)
    rng = np.random.default_rng(1)
    x = random_inputs(rng, 1, 128, 256, jnp.bfloat16)
    idx = make_routing(rng, 1, 128, 4, 64, "uniform")
    w = rng.random((1, 128, 4)).astype(np.float32)
    eo = random_inputs(rng, 1, group.capacity, 256, jnp.bfloat16)

    def body(x, idx, w, eo):
      recv, handle = jax_ep.dispatch(group, x[0], idx[0], w[0])
      return recv.x[None], jax_ep.combine(group, eo[0], handle)[None]
    mapped = jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep"))
    args = self.shard(group, x, idx, w, eo)
    options = {} if command_buffers else {"xla_gpu_enable_command_buffer": ""}
    compiled = jax.jit(mapped).lower(*args).compile(compiler_options=options)
    for _ in range(3):  # replays reuse the recorded command buffer
      recv_x, out = map(np.asarray, compiled(*args))
    expected = oracle.dispatch(x, idx, 64, group.capacity)
    np.testing.assert_array_equal(used_rows(recv_x[0], expected[0]["group_sizes"]),
                                  used_rows(expected[0]["recv_x"], expected[0]["group_sizes"]))
    want = oracle.combine(list(eo), expected, w, np.float64)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tolerance(jnp.bfloat16),
                               atol=tolerance(jnp.bfloat16))
