"""`ffi_call` wrappers for the CUDA kernels (primitive layer of the cuda backend).

Each function states the abstract shapes of its custom call; leading batch dimensions from
`jax.vmap` are passed to the kernels as-is (`vmap_method="broadcast_all"`), which run every batch
element in one launch. The high-throughput ops take `stream` (`CommOptions.stream`): None for
XLA's compute stream, XLA's additional GPU stream N their custom call runs on, or an
`OwnStream`: the op on jax_ep's own stream within its SMs, then its join
(jax_ep/backends/streams.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._native import ffi
from jax_ep._native.varying import vary_like_operands
from jax_ep.backends import streams
from jax_ep.backends.options import OwnStream, Stream
from jax_ep.config import EPConfig, RowFormat, fp8_scales_shape


class LocalLayout(NamedTuple):
  """Where the one-rank cuda dispatch put its rows, kept in the handle (int32).

  Attributes:
    slot_row: `[T, K]` row of `recv_x` holding each slot, -1 if it selects nothing or was dropped.
    group_sizes: `[E]` kept rows per expert.
  """
  slot_row: jax.Array
  group_sizes: jax.Array


def _call(target, result_shapes, *args, vmap_method="broadcast_all", has_side_effect=False,
          stream: Stream = None, **attrs):
  if ffi.extension() is None:
    raise RuntimeError(f"jax_ep: the CUDA extension is not built; cannot call {target}")
  if isinstance(stream, OwnStream):
    return vary_like_operands(streams.on_own_stream(target, result_shapes, vmap_method,
                                                    has_side_effect, stream.sms, attrs)(*args),
                              args)
  call = jax.ffi.ffi_call(target, result_shapes, vmap_method=vmap_method,
                          has_side_effect=has_side_effect)
  fn = lambda *a: call(*a, **attrs)
  if stream is not None:
    fn = streams.on_stream(fn, stream, vmap_method)
  elif vmap_method == "sequential":
    fn = streams.looped(fn)
  if has_side_effect:
    fn = streams.unfused(fn)
  return vary_like_operands(fn(*args), args)


def layout_workspace_elems(config: EPConfig, num_tokens: int) -> int:
  ext = ffi.extension()
  return int(ext.local_layout_workspace_elems(num_tokens, config.num_topk, config.num_experts))


def layout_workspace_bytes(config: EPConfig) -> int:
  if ffi.extension() is None:
    return 0
  return 4 * layout_workspace_elems(config, config.max_tokens_per_rank)


def local_layout(config: EPConfig, topk_idx: jax.Array, *, stream: Stream = None):
  num_tokens, num_topk = topk_idx.shape
  i32 = jnp.int32
  shapes = (jax.ShapeDtypeStruct((num_tokens, num_topk), i32),           # slot_row
            jax.ShapeDtypeStruct((config.num_experts,), i32),             # group_sizes
            jax.ShapeDtypeStruct((), i32),                                # num_dropped
            jax.ShapeDtypeStruct((), i32),                                # num_invalid
            jax.ShapeDtypeStruct((layout_workspace_elems(config, num_tokens),), i32))
  slot_row, group_sizes, num_dropped, num_invalid, _ = _call(
      "jax_ep_local_layout", shapes, topk_idx.astype(i32),
      num_experts=np.int64(config.num_experts), capacity=np.int64(config.capacity),
      expert_alignment=np.int64(config.expert_alignment), stream=stream)
  return LocalLayout(slot_row, group_sizes), group_sizes, num_dropped, num_invalid


def _weights_or_placeholder(layout: LocalLayout, topk_weights):
  if topk_weights is not None:
    return topk_weights.astype(jnp.float32), True
  # Not read by the kernels when weighted=False; the operand list is fixed per target.
  return jnp.zeros(layout.slot_row.shape, jnp.float32), False


def local_dispatch(config: EPConfig, x: jax.Array, layout: LocalLayout, topk_weights=None, *,
                   stream: Stream = None):
  weights, weighted = _weights_or_placeholder(layout, topk_weights)
  shape = jax.ShapeDtypeStruct((config.capacity, x.shape[-1]), x.dtype)
  return _call("jax_ep_local_dispatch", shape, x, layout.slot_row, layout.group_sizes, weights,
               capacity=np.int64(config.capacity), weighted=weighted, stream=stream)


# The kernels' fp8::ScaleFormat (ffi/kernels/fp8_rows.h) of each fp8 `RowFormat`.
_SCALE_FORMATS = {RowFormat.FP8: 0, RowFormat.FP8_POW2_SCALES: 1, RowFormat.FP8_UE8M0: 2}


def _fp8_attrs(config: EPConfig, x_scales) -> dict:
  """The fp8 dispatches' attributes: the wire format's scales, and whether `x` comes quantised
  with its `x_scales` (else the kernel quantises it)."""
  return dict(format=np.int64(_SCALE_FORMATS[config.wire_format]),
              given=x_scales is not None)


def _fp8_scales_operand(x_scales):
  # Not read by the kernels when the rows are quantised there; the operand list is fixed.
  return jnp.zeros((1,), jnp.float32) if x_scales is None else x_scales


def _fp8_row_shapes(config: EPConfig, rows: int):
  """`(recv_x, recv_scales)` of `rows` fp8 rows in the group's wire format."""
  shape, dtype = fp8_scales_shape(config.wire_format, rows, config.hidden)
  return (jax.ShapeDtypeStruct((rows, config.hidden), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct(shape, dtype))


def local_dispatch_fp8(config: EPConfig, x: jax.Array, x_scales, layout: LocalLayout, *,
                       stream: Stream = None):
  """`(recv_x [C, H] e4m3, recv_scales)`: `x` `[T, H]` (the activations, quantised by the
  kernel once per token, or e4m3 rows with their `x_scales`) placed along `layout` in the
  group's fp8 `wire_format` (ffi/kernels/local_dispatch_fp8.cu)."""
  return _call("jax_ep_local_dispatch_fp8", _fp8_row_shapes(config, config.capacity), x,
               _fp8_scales_operand(x_scales), layout.slot_row,
               capacity=np.int64(config.capacity), **_fp8_attrs(config, x_scales),
               stream=stream)


def fp8_quantize(config: EPConfig, x: jax.Array, *, stream: Stream = None):
  """`(q [T, H] e4m3, scales)` of the activations `x` `[T, H]` in the group's fp8
  `wire_format`, rounded by the dispatch kernels (bit for bit `jax_ep._native.fp8`'s): the
  one-rank fp8 dispatch along the identity layout, token t to row t."""
  *lead, num_tokens, _ = x.shape
  identity = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
  identity = jnp.broadcast_to(identity, (*lead, num_tokens, 1))
  shape, dtype = fp8_scales_shape(config.wire_format, num_tokens, config.hidden)
  # Leading dims of `x` (batches, as vmap's would be) on the results too.
  shapes = (jax.ShapeDtypeStruct((*lead, num_tokens, config.hidden), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((*lead, *shape), dtype))
  return _call("jax_ep_local_dispatch_fp8", shapes, x, _fp8_scales_operand(None), identity,
               capacity=np.int64(num_tokens), **_fp8_attrs(config, None), stream=stream)


def local_combine(config: EPConfig, expert_out: jax.Array, layout: LocalLayout,
                  topk_weights=None, *, stream: Stream = None):
  weights, weighted = _weights_or_placeholder(layout, topk_weights)
  num_tokens = layout.slot_row.shape[0]
  shape = jax.ShapeDtypeStruct((num_tokens, expert_out.shape[-1]), expert_out.dtype)
  return _call("jax_ep_local_combine", shape, expert_out, layout.slot_row, weights,
               weighted=weighted, stream=stream)


def local_combine_vjp(config: EPConfig, d_out: jax.Array, expert_out: jax.Array,
                      layout: LocalLayout, *, stream: Stream = None):
  shape = jax.ShapeDtypeStruct(layout.slot_row.shape, jnp.float32)
  return _call("jax_ep_local_combine_vjp", shape, d_out.astype(expert_out.dtype), expert_out,
               layout.slot_row, stream=stream)


# ----------------------------------------------------------------------------------------------
# Multi-rank peer transport. One custom call per op; the kernels move rows straight
# into the peers' library-owned buffers. These ops take no leading batch dims: under vmap JAX
# runs one round per batch element (`vmap_method="sequential"`).

class PeerLayout(NamedTuple):
  """Where the multi-rank cuda dispatch put its rows, kept in the handle.

  Attributes:
    send_pos: `[T, R]` int32 position of token t in this rank's send list for rank d, or -1.
    entry_row: `[N, K]` int32 (N = R * T_max) row of `recv_x` holding received entry (s, i, k).
    entry_weights: `[N, K]` float32 on the receiver: the `topk_weights` entry that came with
      each received entry (s, i, k), 0 where none did.
    recv_counts: `[R]` int32 tokens received from each source rank.
    group_sizes: `[L]` int32 kept rows per local expert.
    topk_idx: `[T, K]` int32 this rank's expert ids (the weight gradient places slots by them).
  """
  send_pos: jax.Array
  entry_row: jax.Array
  entry_weights: jax.Array
  recv_counts: jax.Array
  group_sizes: jax.Array
  topk_idx: jax.Array


# The configuration fields of the `group` attribute, by name (ffi/handlers/group_common.h,
# GroupRef, decodes them by name), each read from the group's `EPConfig`.
GROUP_FIELDS: dict[str, Callable[[EPConfig], int]] = {
    "num_ranks": lambda c: c.num_ranks,
    "num_experts": lambda c: c.num_experts,
    "num_topk": lambda c: c.num_topk,
    "hidden": lambda c: c.hidden,
    "max_tokens_per_rank": lambda c: c.max_tokens_per_rank,
    "itemsize": lambda c: np.dtype(c.dtype).itemsize,
    "capacity": lambda c: c.capacity,
    "expert_alignment": lambda c: c.expert_alignment,
}


def group_attrs(config: EPConfig, group_id: int) -> dict:
  """The attribute that names an op's native group: `group`, a dictionary of the group's `id`
  (its number in this process) and the configuration this program is built for
  (`GROUP_FIELDS`). The handler compares the configuration with the group it finds and fails
  with a message naming the field that differs.

  NOTES: ids are numbered per process. A program traced here carries this process's id, and
  jax's persistent compilation cache keys on the program text (the id with it), so an
  executable it returns is one this process would have compiled; the configuration catches a
  program built elsewhere (exported, serialized) whose id names a group of another
  configuration here (docs/decisions.md, "Group ids").
  """
  fields = {name: np.int64(get(config)) for name, get in GROUP_FIELDS.items()}
  return {"group": {"id": np.int64(group_id), **fields}}


def _group_call(target, result_shapes, *args, stream: Stream = None, **attrs):
  # NOTES: has_side_effect keeps XLA from dropping or merging a call whose results one rank
  # does not use: every rank must issue the same ops of a group in the same order, or its peers
  # wait for data that never comes. No batch dims in the kernels: vmap loops.
  return _call(target, result_shapes, *args, vmap_method="sequential", has_side_effect=True,
               stream=stream, **attrs)


def _storage_rows(rows: int) -> int:
  """Rows of a group op's row-indexed buffer (`[capacity, H]`, `[T, ...]`): at least one.

  NOTES: XLA:GPU (jaxlib 0.11.2) segfaulted compiling a side-effecting custom call with a
  zero-row result (capacity 0, seen on the H200; see StorageRows in
  ffi/handlers/group_common.h). Zero-row buffers therefore travel as one inert row (zeros, or
  -1 for ids and positions: a token sent nowhere) and the results are sliced back here.
  """
  return max(rows, 1)


def _with_one_row(a, fill):
  """`a` (rows on axis 0), or one row of `fill` when it has none (see `_storage_rows`)."""
  if a.shape[0] > 0:
    return a
  return jnp.full((1, *a.shape[1:]), fill, a.dtype)


def _peer_layout_shapes(config: EPConfig, num_tokens: int, num_topk: int):
  """The results of both peer dispatches after their rows: the layout, counts and status."""
  ext = ffi.extension()
  r, n, i32 = config.num_ranks, config.num_ranks * config.max_tokens_per_rank, jnp.int32
  workspace = int(ext.peer_dispatch_workspace_elems(r, config.max_tokens_per_rank, num_topk,
                                                     config.num_experts))
  t_rows = _storage_rows(num_tokens)
  return (jax.ShapeDtypeStruct((config.num_local_experts,), i32),          # group_sizes
            jax.ShapeDtypeStruct((), i32),                                   # num_dropped
            jax.ShapeDtypeStruct((), i32),                                   # num_invalid
            jax.ShapeDtypeStruct((t_rows, r), i32),                          # send_pos
            jax.ShapeDtypeStruct((n, num_topk), i32),                        # entry_row
            jax.ShapeDtypeStruct((n, num_topk), jnp.float32),                # entry_weights
            jax.ShapeDtypeStruct((r,), i32),                                 # recv_counts
            jax.ShapeDtypeStruct((), i32),                                   # status
            jax.ShapeDtypeStruct((workspace,), i32))                         # workspace


def _peer_dispatch_results(topk_idx, outs):
  """`(group_sizes, num_dropped, num_invalid, layout, status)` from a peer dispatch's results
  after its rows."""
  (group_sizes, num_dropped, num_invalid, send_pos, entry_row, entry_weights, recv_counts,
   status, _) = outs
  layout = PeerLayout(send_pos[:topk_idx.shape[0]], entry_row, entry_weights, recv_counts,
                      group_sizes, topk_idx)
  return group_sizes, num_dropped, num_invalid, layout, status


def peer_dispatch(config: EPConfig, group_id: int, x, topk_idx, topk_weights, *,
                  stream: Stream = None):
  """Returns `(recv_x, group_sizes, num_dropped, num_invalid, layout, status)`."""
  num_tokens, num_topk = topk_idx.shape
  shapes = (jax.ShapeDtypeStruct((_storage_rows(config.capacity), x.shape[-1]), x.dtype),
            *_peer_layout_shapes(config, num_tokens, num_topk))
  recv_x, *outs = _group_call(
      "jax_ep_peer_dispatch", shapes, _with_one_row(x, 0), _with_one_row(topk_idx, -1),
      _with_one_row(topk_weights.astype(jnp.float32), 0), **group_attrs(config, group_id),
      num_experts=np.int64(config.num_experts), capacity=np.int64(config.capacity),
      stream=stream)
  return (recv_x[:config.capacity], *_peer_dispatch_results(topk_idx, outs))


def peer_dispatch_fp8(config: EPConfig, group_id: int, x, x_scales, topk_idx, topk_weights, *,
                      stream: Stream = None):
  """The peer dispatch with fp8 rows in the group's `wire_format` (`x` the activations,
  quantised by the sending kernel once per token, or e4m3 rows with their `x_scales`).
  Returns `(recv_x [C, H] e4m3, recv_scales, group_sizes, num_dropped, num_invalid, layout,
  status)`; the layout is `peer_dispatch`'s."""
  num_tokens, num_topk = topk_idx.shape
  shapes = (*_fp8_row_shapes(config, _storage_rows(config.capacity)),
            *_peer_layout_shapes(config, num_tokens, num_topk))
  scales = _fp8_scales_operand(x_scales)
  if x_scales is not None:
    scales = _with_one_row(scales, 0)
  recv_x, recv_scales, *outs = _group_call(
      "jax_ep_peer_dispatch_fp8", shapes, _with_one_row(x, 0), scales,
      _with_one_row(topk_idx, -1), _with_one_row(topk_weights.astype(jnp.float32), 0),
      **group_attrs(config, group_id), num_experts=np.int64(config.num_experts),
      capacity=np.int64(config.capacity), **_fp8_attrs(config, x_scales), stream=stream)
  return (recv_x[:config.capacity], recv_scales[:config.capacity],
          *_peer_dispatch_results(topk_idx, outs))


def peer_dispatch_cached(config: EPConfig, group_id: int, x, layout: PeerLayout,
                         weighted: bool, *, stream: Stream = None):
  """Returns `(recv_x, status)`: rows placed by an earlier dispatch's layout."""
  shapes = (jax.ShapeDtypeStruct((_storage_rows(config.capacity), x.shape[-1]), x.dtype),
            jax.ShapeDtypeStruct((), jnp.int32))
  recv_x, status = _group_call(
      "jax_ep_peer_dispatch_cached", shapes, _with_one_row(x, 0),
      _with_one_row(layout.send_pos, -1), layout.entry_row, layout.entry_weights,
      layout.group_sizes, **group_attrs(config, group_id), capacity=np.int64(config.capacity),
      weighted=bool(weighted), stream=stream)
  return recv_x[:config.capacity], status


def peer_combine(config: EPConfig, group_id: int, expert_out, layout: PeerLayout,
                 weighted: bool, *, stream: Stream = None):
  """Returns `(out [T, H], status)`."""
  num_tokens = layout.send_pos.shape[0]
  shapes = (jax.ShapeDtypeStruct((_storage_rows(num_tokens), expert_out.shape[-1]),
                                 expert_out.dtype),
            jax.ShapeDtypeStruct((), jnp.int32))
  out, status = _group_call(
      "jax_ep_peer_combine", shapes, _with_one_row(expert_out, 0), layout.entry_row,
      layout.entry_weights, layout.recv_counts, _with_one_row(layout.send_pos, -1),
      **group_attrs(config, group_id), weighted=bool(weighted), stream=stream)
  return out[:num_tokens], status


def peer_combine_vjp(config: EPConfig, group_id: int, d_out, expert_out,
                     layout: PeerLayout, *, stream: Stream = None):
  """Returns `(d_expert_out [C, H], d_topk_weights [T, K] f32, status)`."""
  num_tokens, num_topk = layout.topk_idx.shape
  padded = _with_one_row(expert_out, 0)
  shapes = (jax.ShapeDtypeStruct(padded.shape, expert_out.dtype),
            jax.ShapeDtypeStruct((_storage_rows(num_tokens), num_topk), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.int32))
  d_expert_out, d_topk_weights, status = _group_call(
      "jax_ep_peer_combine_vjp", shapes, _with_one_row(d_out.astype(expert_out.dtype), 0),
      padded, _with_one_row(layout.topk_idx, -1), _with_one_row(layout.send_pos, -1),
      layout.entry_row, layout.entry_weights, layout.recv_counts, layout.group_sizes,
      **group_attrs(config, group_id), num_experts=np.int64(config.num_experts),
      capacity=np.int64(config.capacity), stream=stream)
  return d_expert_out[:config.capacity], d_topk_weights[:num_tokens], status


def rail_exchange(config: EPConfig, group_id: int, num_hosts: int, sources, index, counts,
                  pes, *, stream: Stream = None):
  """The rail exchange of a network group (ffi/kernels/rail_exchange.cu): block h of every
  source (rows `index[h, j]`, `j < counts[h]`) to the rail peer on host h (`pes[h]`).

  Returns `(received, recv_counts, status)`: per source `[Hn, T_max, ...]` (block h' from the
  rail peer on host h', zero past its count), `[Hn]` those counts, and the status.
  """
  t_max, i32 = config.max_tokens_per_rank, jnp.int32
  sources = tuple(_with_one_row(s, 0) for s in sources)
  shapes = (jax.ShapeDtypeStruct((num_hosts,), i32), jax.ShapeDtypeStruct((), i32),
            *(jax.ShapeDtypeStruct((num_hosts * t_max, *s.shape[1:]), s.dtype) for s in sources))
  recv_counts, status, *outs = _group_call(
      "jax_ep_rail_exchange", shapes, index.astype(i32), counts.astype(i32), pes.astype(i32),
      *sources, **group_attrs(config, group_id), stream=stream)
  received = tuple(o.reshape(num_hosts, t_max, *o.shape[1:]) for o in outs)
  return received, recv_counts, status


# ---------------------------------------------------------------------------------- low latency

class LowLatencyLayout(NamedTuple):
  """Where the cuda low-latency dispatch put its rows, kept in the handle (int32).

  Attributes:
    topk_idx: `[T, K]` the home rank's expert ids (the combine reduces its slots).
    recv_src: `[L, R*T_max]` per received row `s * T_max * K + t * K + k` (source rank,
      token, first slot naming the expert), -1 past `count`.
    count: `[L]` rows per local expert.
  """
  topk_idx: jax.Array
  recv_src: jax.Array
  count: jax.Array


# The kernels' row formats (low_latency::RowFormat: kPlain, kFp8, kFp8PowerOfTwo).
LL_PLAIN, LL_FP8, LL_FP8_POWER_OF_TWO = 0, 1, 2
# `RowFormat` -> the handlers' `(format, ue8m0)` attributes.
_KERNEL_FORMATS = {RowFormat.PLAIN: (LL_PLAIN, False), RowFormat.FP8: (LL_FP8, False),
                   RowFormat.FP8_POW2_SCALES: (LL_FP8_POWER_OF_TWO, False),
                   RowFormat.FP8_UE8M0: (LL_FP8_POWER_OF_TWO, True)}


def low_latency_format(row_format: RowFormat) -> tuple[int, bool]:
  """`(format, ue8m0)`, the kernels' attributes for `row_format`."""
  return _KERNEL_FORMATS[RowFormat(row_format)]


def _ll_call(target, result_shapes, *args, **attrs):
  # NOTES: vmap_method=None: a batched split call would issue every batch element's send
  # before any wait, which the protocol refuses (one outstanding send per op); the fused ops
  # are batched above this layer instead (one send + wait per element). has_side_effect: see
  # _group_call.
  return _call(target, result_shapes, *args, vmap_method=None, has_side_effect=True, **attrs)


def _ll_dispatch_shapes(config: EPConfig, x_dtype, fmt: int, ue8m0: bool):
  num_local, slab, hidden = config.num_local_experts, config.low_latency_slab, config.hidden
  i32 = jnp.int32
  if fmt == LL_PLAIN:
    rows = jax.ShapeDtypeStruct((num_local, slab, hidden), x_dtype)
    scales = jax.ShapeDtypeStruct((1,), jnp.float32)  # not written
  else:
    rows = jax.ShapeDtypeStruct((num_local, slab, hidden), jnp.float8_e4m3fn)
    scales = (jax.ShapeDtypeStruct((num_local, slab, hidden // 512), i32) if ue8m0 else
              jax.ShapeDtypeStruct((num_local, slab, hidden // 128), jnp.float32))
  return (rows, scales, jax.ShapeDtypeStruct((num_local,), i32),
          jax.ShapeDtypeStruct((num_local, slab), i32), jax.ShapeDtypeStruct((), i32))


def _ll_send_operands(x, topk_idx, topk_weights):
  weighted = topk_weights is not None
  scale = topk_weights if weighted else jnp.zeros(topk_idx.shape, jnp.float32)
  scale = scale.astype(jnp.float32)
  return (_with_one_row(x, 0), _with_one_row(topk_idx.astype(jnp.int32), -1),
          _with_one_row(scale, 0)), weighted


def low_latency_dispatch(config: EPConfig, group_id: int, x, topk_idx,
                         row_format: RowFormat = RowFormat.PLAIN, topk_weights=None):
  """Send and wait in one call. Returns `(recv_x, scales or None, count, num_invalid, layout,
  status)`; `topk_weights` `[T, K]` scales the row sent for each slot (plain rows only)."""
  fmt, ue8m0 = low_latency_format(row_format)
  operands, weighted = _ll_send_operands(x, topk_idx, topk_weights)
  shapes = (jax.ShapeDtypeStruct((), jnp.int32), *_ll_dispatch_shapes(config, x.dtype, fmt, ue8m0))
  num_invalid, recv_x, scales, count, recv_src, status = _call(
      "jax_ep_low_latency_dispatch", shapes, *operands, vmap_method="sequential",
      has_side_effect=True, **group_attrs(config, group_id), format=np.int32(fmt),
      weighted=weighted, ue8m0=ue8m0)
  layout = LowLatencyLayout(topk_idx.astype(jnp.int32), recv_src, count)
  return recv_x, (None if fmt == LL_PLAIN else scales), count, num_invalid, layout, status


def low_latency_dispatch_send(config: EPConfig, group_id: int, x, topk_idx,
                              row_format: RowFormat = RowFormat.PLAIN):
  """The send alone: returns `num_invalid` (the token the wait takes)."""
  fmt, _ = low_latency_format(row_format)
  operands, weighted = _ll_send_operands(x, topk_idx, None)
  return _ll_call("jax_ep_low_latency_dispatch_send", jax.ShapeDtypeStruct((), jnp.int32),
                  *operands, **group_attrs(config, group_id), format=np.int32(fmt),
                  weighted=weighted)


def low_latency_dispatch_wait(config: EPConfig, group_id: int, sent, topk_idx, x_dtype,
                              row_format: RowFormat = RowFormat.PLAIN):
  """The wait alone: `(recv_x, scales or None, count, layout, status)`."""
  fmt, ue8m0 = low_latency_format(row_format)
  recv_x, scales, count, recv_src, status = _ll_call(
      "jax_ep_low_latency_dispatch_wait", _ll_dispatch_shapes(config, x_dtype, fmt, ue8m0), sent,
      **group_attrs(config, group_id), format=np.int32(fmt), ue8m0=ue8m0)
  layout = LowLatencyLayout(topk_idx.astype(jnp.int32), recv_src, count)
  return recv_x, (None if fmt == LL_PLAIN else scales), count, layout, status


def _ll_combine_shape(config: EPConfig, num_tokens: int, dtype, gather: bool):
  rows = _storage_rows(num_tokens)
  if gather:
    return jax.ShapeDtypeStruct((rows, config.num_topk, config.hidden), dtype)
  return jax.ShapeDtypeStruct((rows, config.hidden), dtype)


def low_latency_combine(config: EPConfig, group_id: int, expert_out, layout: LowLatencyLayout,
                        topk_weights, gather: bool = False):
  """Send and wait in one call: `(out [T, H] (or [T, K, H] with gather), status)`."""
  num_tokens = layout.topk_idx.shape[0]
  w = (jnp.zeros(layout.topk_idx.shape, jnp.float32) if topk_weights is None
       else topk_weights)
  out, status = _call(
      "jax_ep_low_latency_combine",
      (_ll_combine_shape(config, num_tokens, expert_out.dtype, gather),
       jax.ShapeDtypeStruct((), jnp.int32)),
      expert_out, layout.recv_src, layout.count, _with_one_row(layout.topk_idx, -1),
      _with_one_row(w.astype(jnp.float32), 0), vmap_method="sequential", has_side_effect=True,
      **group_attrs(config, group_id), num_experts=np.int64(config.num_experts), gather=gather)
  return out[:num_tokens], status


def low_latency_combine_send(config: EPConfig, group_id: int, expert_out,
                             layout: LowLatencyLayout):
  return _ll_call("jax_ep_low_latency_combine_send", jax.ShapeDtypeStruct((), jnp.int32),
                  expert_out, layout.recv_src, layout.count, **group_attrs(config, group_id))


def low_latency_combine_wait(config: EPConfig, group_id: int, sent, layout: LowLatencyLayout,
                             topk_weights, dtype):
  num_tokens = layout.topk_idx.shape[0]
  out, status = _ll_call(
      "jax_ep_low_latency_combine_wait",
      (_ll_combine_shape(config, num_tokens, dtype, False), jax.ShapeDtypeStruct((), jnp.int32)),
      sent, _with_one_row(layout.topk_idx, -1),
      _with_one_row(topk_weights.astype(jnp.float32), 0), **group_attrs(config, group_id),
      num_experts=np.int64(config.num_experts), gather=False)
  return out[:num_tokens], status
