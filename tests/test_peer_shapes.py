"""Shapes the peer ops hand to XLA (CPU-checkable part of the multi-rank cuda path).

XLA:GPU segfaulted compiling a side-effecting custom call with a zero-row result (capacity 0 on
the H200), so no peer custom call may take or produce a zero-row buffer: capacity 0 and T = 0
travel as one inert row and are sliced back. The custom call is faked here; it records what it
was given and returns zeros of the requested shapes.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep.backends import cuda_ops
from jax_ep._native import ffi as _ffi
from jax_ep.config import EPConfig


@pytest.fixture
def calls(monkeypatch):
  seen = []

  def fake_group_call(target, result_shapes, *args, **attrs):
    seen.append((target, [a.shape for a in args], [s.shape for s in result_shapes], args))
    return tuple(jnp.zeros(s.shape, s.dtype) for s in result_shapes)

  class FakeExtension:
    @staticmethod
    def peer_dispatch_workspace_elems(*_):
      return 16

  monkeypatch.setattr(cuda_ops, "_group_call", fake_group_call)
  monkeypatch.setattr(cuda_ops.ffi, "extension", lambda: FakeExtension)
  return seen


def _no_zero_rows(seen):
  for target, arg_shapes, result_shapes, _ in seen:
    for shape in arg_shapes + result_shapes:
      assert not (len(shape) >= 1 and shape[0] == 0), (target, arg_shapes, result_shapes)


@pytest.mark.parametrize("num_tokens,capacity", [(0, 64), (5, 0), (0, 0), (5, 64)])
def test_peer_ops_never_pass_zero_rows(calls, num_tokens, capacity):
  r, h, k = 2, 128, 2
  config = EPConfig("ep", r, 8, k, h, 16, np.dtype(jnp.bfloat16), capacity)
  x = jnp.ones((num_tokens, h), jnp.bfloat16)
  idx = jnp.zeros((num_tokens, k), jnp.int32)
  w = jnp.ones((num_tokens, k), jnp.float32)
  recv_x, group_sizes, _, _, routing, _ = cuda_ops.peer_dispatch(config, 7, x, idx, w)
  assert recv_x.shape == (capacity, h) and group_sizes.shape == (4,)
  assert routing.send_pos.shape == (num_tokens, r) and routing.topk_idx.shape == (num_tokens, k)
  # The inert token row routes nowhere (-1) and carries zeros.
  _, dispatch_shapes, _, dispatch_args = calls[0]
  assert dispatch_shapes[:3] == [(max(num_tokens, 1), h), (max(num_tokens, 1), k),
                                 (max(num_tokens, 1), k)]
  if num_tokens == 0:
    np.testing.assert_array_equal(dispatch_args[1], -1)
    np.testing.assert_array_equal(dispatch_args[0].astype(np.float32), 0)
  out, _ = cuda_ops.peer_combine(config, 7, recv_x, routing, weighted=True)
  assert out.shape == (num_tokens, h)
  again, _ = cuda_ops.peer_dispatch_cached(config, 7, x, routing, weighted=False)
  assert again.shape == (capacity, h)
  d_expert_out, d_weights, _ = cuda_ops.peer_combine_vjp(config, 7, out, recv_x, routing)
  assert d_expert_out.shape == (capacity, h) and d_weights.shape == (num_tokens, k)
  _no_zero_rows(calls)


@pytest.mark.skipif(_ffi.extension() is None, reason="needs the built extension (host code only)")
@pytest.mark.parametrize("max_tokens", [1, 19, 4096, 65600, 100000])
def test_dispatch_workspace_covers_every_token_count(max_tokens):
  """The dispatch runs the local layout once per destination on the call's T tokens, however
  many up to T_max: its workspace must cover the layout's scratch for every such T. The layout's
  chunk count is not monotone in T past 2^19 slots (T_max=65600 needs fewer chunks than
  T=65536), which a workspace sized from T_max alone got wrong."""
  ext = _ffi.extension()
  r, k, e = 8, 8, 256
  send_tiles = max(1, -(-max_tokens // 512))  # peer::DispatchSendTiles
  fixed = (4 * r + r * (max_tokens + 1) + 2 * r * max_tokens * k + 2 * e
           + (r + 1) * send_tiles)
  layout_room = ext.peer_dispatch_workspace_elems(r, max_tokens, k, e) - fixed
  candidates = {max_tokens, max(max_tokens - 64, 1), 65536, 98304, 1 << 16, 16384, 1}
  need = max(ext.local_layout_workspace_elems(t, k, e // r)
             for t in candidates if t <= max_tokens)
  assert layout_room >= r * need, (max_tokens, layout_room, r * need)


@pytest.mark.parametrize("num_ranks,max_tokens,num_topk,num_experts", [
    (2, 4096, 8, 256), (8, 4096, 8, 256), (1, 1, 1, 1), (3, 1000, 6, 48), (64, 513, 32, 64)])
def test_dispatch_workspace_is_sized_and_carved_in_one_place(num_ranks, max_tokens, num_topk,
                                                             num_experts):
  """The parts of the dispatch workspace follow each other without gaps or overlap, in the
  documented order, and the size the handler allocates is where the last one ends."""
  from jax_ep._native import ffi as _ffi
  ext = _ffi.extension()
  if ext is None:
    pytest.skip("built without the CUDA extension")
  parts = dict(ext.peer_dispatch_workspace(num_ranks, max_tokens, num_topk, num_experts))
  r, t, k, e = num_ranks, max_tokens, num_topk, num_experts
  tiles = max(-(-t // 512), 1)
  sizes = {"count_to": r, "layout_dropped": r, "layout_invalid": r, "source_chunks": r,
           "chunk_start": r * (t + 1), "dest_ids": r * t * k, "slot_rank": r * t * k,
           "dest_counts": e, "offset": e, "tile_count": r * tiles, "invalid_count": tiles}
  at = 0
  for name, size in sizes.items():
    assert parts[name] == at, name
    at += size
  assert parts["layout"] == at
  layout = r * ext.local_layout_workspace_elems(t, k, e // r)
  assert parts["elems"] >= parts["layout"] + layout
  assert parts["elems"] == ext.peer_dispatch_workspace_elems(r, t, k, e)


@pytest.mark.parametrize("given", [False, True], ids=["quantised", "given"])
@pytest.mark.parametrize("num_tokens,capacity", [(0, 64), (5, 0), (5, 64)])
def test_peer_fp8_dispatch_never_passes_zero_rows(calls, num_tokens, capacity, given):
  """The fp8 peer dispatch: the same inert rows (e4m3 x and its scales padded together; a
  one-element placeholder for the scales of rows the kernel quantises), its rows and scales in
  the wire format's shapes."""
  from jax_ep.config import RowFormat
  r, h, k = 2, 1024, 2
  config = EPConfig("ep", r, 8, k, h, 16, np.dtype(jnp.bfloat16), capacity,
                    wire_format=RowFormat.FP8_UE8M0)
  x = jnp.ones((num_tokens, h), jnp.float8_e4m3fn if given else jnp.bfloat16)
  scales = jnp.ones((num_tokens, h // 512), jnp.int32) if given else None
  idx = jnp.zeros((num_tokens, k), jnp.int32)
  w = jnp.ones((num_tokens, k), jnp.float32)
  recv_x, recv_scales, group_sizes, _, _, routing, _ = cuda_ops.peer_dispatch_fp8(
      config, 7, x, scales, idx, w)
  assert recv_x.shape == (capacity, h) and recv_x.dtype == jnp.float8_e4m3fn
  assert recv_scales.shape == (capacity, h // 512) and recv_scales.dtype == jnp.int32
  assert group_sizes.shape == (4,) and routing.send_pos.shape == (num_tokens, r)
  target, arg_shapes, result_shapes, _ = calls[0]
  rows = max(num_tokens, 1)
  assert target == "jax_ep_peer_dispatch_fp8"
  assert arg_shapes[0] == (rows, h) and arg_shapes[2:4] == [(rows, k), (rows, k)]
  assert arg_shapes[1] == ((rows, h // 512) if given else (1,))
  assert result_shapes[:2] == [(max(capacity, 1), h), (max(capacity, 1), h // 512)]
  _no_zero_rows(calls)
