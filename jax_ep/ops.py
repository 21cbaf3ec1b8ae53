"""Public ops: high-throughput `dispatch`/`combine` (the low-latency pair is
jax_ep/low_latency.py, on the checks and handle origins here).

All are per-shard functions: call them inside `jax.shard_map` over the group's axis, like
`jax.lax.psum`. Arguments are validated at trace time; errors name the argument, what it was and
what was expected.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._native.varying import vary_like_operands
from jax_ep.backends import primitives
from jax_ep.config import (DTYPES, RowFormat, alignment_padding, as_row_format, check_dtype,
                           check_fp8_hidden, fp8_scales_shape)
from jax_ep.experts import configs as experts_configs, quantize_kernel
from jax_ep.experts.layout import rows_inside_groups
from jax_ep.group import Group
from jax_ep.routing import merge_duplicate_slots


class DispatchResult(NamedTuple):
  """What a rank receives from a high-throughput dispatch.

  Attributes:
    x: `[capacity, H]` rows grouped by local expert `0..L-1`; inside one expert ordered by
      (source rank, source token): the input `jax_ep.grouped_matmul(x, w[L, ...],
      group_sizes, group_offsets=group_offsets)` takes. Expert `l`'s rows are
      `x[group_offsets[l] : group_offsets[l] + group_sizes[l]]`. The other rows (past the
      groups, and with `expert_alignment > 1` the padding between them) are unspecified on the
      cuda backend (dispatch does not write them; zeros on the reference backend): nothing in
      jax_ep reads them, so the worst-case capacity costs memory and never time. Code of your
      own that mixes rows masks them first (`valid_rows()`, `jax_ep.zero_padding`). A token
      whose slots name one expert several times has one row there (see `dispatch`).
    group_sizes: `[L]` int32 rows per local expert (kept rows only).
    num_dropped: `[]` int32 rows that did not fit in `capacity` on this rank.
    num_invalid: `[]` int32 slots of *this rank's* `topk_idx` outside `[-1, E)` (treated as -1).
    group_offsets: `[L]` int32 the row where each local expert's rows start: the exclusive
      cumulative sum of `group_sizes`, each rounded up to a multiple of the group's
      `expert_alignment` (with the default 1, of `group_sizes` itself), at most `capacity` (an
      expert that kept no row because the buffer was full starts at `capacity`).
    scales: with an fp8 `wire_format` (`jax_ep.Group`), `x` is float8_e4m3fn and row `i`
      stands for `x[i]` times `scales[i]`, one scale per 128 channels: `[capacity, H/128]`
      float32 (`[capacity, H/512]` int32 UE8M0 exponents, four to a word, the first in the
      lowest byte, with `RowFormat.FP8_UE8M0`); rows outside the groups as in `x` (zeros on
      the reference backend). `jax_ep.dequantize(recv.x, recv.scales)` gives the rows in the
      group's dtype. None with the default PLAIN wire format.
  """
  x: jax.Array
  group_sizes: jax.Array
  num_dropped: jax.Array
  num_invalid: jax.Array
  group_offsets: jax.Array
  scales: jax.Array | None = None

  def valid_rows(self) -> jax.Array:
    """`[capacity]` bool: the rows of `x` that hold dispatched tokens (inside
    `[group_offsets[l], group_offsets[l] + group_sizes[l])` for some expert `l`)."""
    return rows_inside_groups(self.group_sizes, self.group_offsets, self.x.shape[-2])


def group_offsets(group_sizes, expert_alignment: int, capacity: int) -> jax.Array:
  """`[..., L]` int32: where each expert's rows start in a dispatch result with these (kept)
  `group_sizes` `[..., L]`: `sum_{l' < l} roundup(group_sizes[l'], expert_alignment)`, at most
  `capacity`."""
  sizes = group_sizes.astype(jnp.int32)
  padded = sizes
  if expert_alignment > 1:
    padded = (sizes + (expert_alignment - 1)) // expert_alignment * expert_alignment
  starts = jnp.cumsum(padded, axis=-1, dtype=jnp.int32) - padded
  return jnp.minimum(starts, capacity).astype(jnp.int32)


def zero_padding(recv: DispatchResult) -> DispatchResult:
  """`recv` with zeros in the rows of `recv.x` outside the groups (past them, and the padding
  of `expert_alignment` between them), for code of your own that mixes rows (a reduction over
  all rows, `jax.lax.ragged_dot` on a GPU). It reads and writes the whole `[capacity, H]`
  buffer: jax_ep's own ops never need it."""
  if not isinstance(recv, DispatchResult):
    raise TypeError(f"jax_ep.zero_padding: recv must be a DispatchResult, got "
                    f"{type(recv).__name__}")
  valid = recv.valid_rows()[..., None]
  scales = recv.scales
  if scales is not None:  # an fp8 dispatch's: a zero scale for a zero row
    scales = jnp.where(valid, scales, jnp.zeros((), scales.dtype))
  return recv._replace(x=jnp.where(valid, recv.x, jnp.zeros((), recv.x.dtype)), scales=scales)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class HandleOrigin:
  """The group a handle was made on. Static (part of the pytree's structure, no arrays), so it
  stays with the handle through `jit`, `shard_map`, `scan` and `grad`; the combines refuse a
  handle of another group, whose layout indexes rows and buffers that are not theirs.

  Attributes:
    key: the group's identity, one per group created in this process.
    group: the group's description, for messages (not compared).
  """
  key: str
  group: str = dataclasses.field(compare=False)


def _origin(group: Group) -> HandleOrigin:
  return HandleOrigin(group._key, repr(group))


def _check_origin(group: Group, op: str, origin, made_by: str, what: str = "handle") -> None:
  """Raises unless `origin` (of a handle or a send in flight) is `group`'s."""
  if not isinstance(origin, HandleOrigin):
    raise TypeError(f"jax_ep.{op}: {what} must be what jax_ep.{made_by} returned; this one "
                    f"does not say which group made it (origin {origin!r})")
  if origin.key != group._key:
    same = " (a group of the same configuration: each has its own layout and buffers)" if (
        origin.group == repr(group)) else ""
    raise ValueError(f"jax_ep.{op}: {what} was made by jax_ep.{made_by} on another group, "
                     f"{origin.group}{same}; this call's group is {group!r}. Pass the group "
                     f"that made it")


class Handle(NamedTuple):
  """What `combine` and the gradients reuse from `dispatch` (a pytree of arrays).

  Attributes:
    layout: backend-specific integer metadata: where dispatch put each row.
    topk_weights: `[T, K]` float32 router weights given to dispatch, after the merge of
      duplicate slots (`merge_duplicate_slots`: a merged slot's weight is in the first slot
      naming its expert, the later ones are 0); differentiable in the given weights.
    origin: the group dispatch ran on (`HandleOrigin`, no arrays); `combine` refuses the
      handle on any other group.
  """
  layout: Any
  topk_weights: jax.Array
  origin: HandleOrigin | None = None


def _check_group(group, op: str) -> None:
  if not isinstance(group, Group):
    raise TypeError(f"jax_ep.{op}: group must be a jax_ep.Group, got {type(group).__name__}")
  if group.closed:
    raise ValueError(f"jax_ep.{op}: the group was closed")
  try:
    size = jax.lax.axis_size(group.axis_name)
  except NameError:
    raise ValueError(
        f"jax_ep.{op} must be called inside jax.shard_map over the group's mesh axis "
        f"{group.axis_name!r}, which is not bound here. Wrap the per-shard code in "
        f"jax.shard_map(f, mesh=group.mesh, in_specs=..., out_specs=...).") from None
  if size != group.num_ranks:
    raise ValueError(f"jax_ep.{op}: axis {group.axis_name!r} has size {size} here but the group "
                     f"was created with {group.num_ranks} ranks")
  group.check()  # a group that failed at run time (timeout, strict drop) refuses new ops


def _check_array(op: str, name: str, value, *, ndim: int, dtypes, shape=None) -> None:
  spelled = "[" + ", ".join(shape) + "]" if shape else ""
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    got = "None" if value is None else type(value).__name__
    raise TypeError(f"jax_ep.{op}: {name} must be an array {spelled}, got {got}")
  if value.ndim != ndim:
    raise ValueError(f"jax_ep.{op}: {name} must have {ndim} dimensions {spelled}, got shape "
                     f"{value.shape}")
  dtypes = tuple(np.dtype(d) for d in dtypes)
  if np.dtype(value.dtype) not in dtypes:
    want = " or ".join(str(d) for d in dtypes)
    raise TypeError(f"jax_ep.{op}: {name} must have dtype {want}, got {value.dtype}")


def _check_tokens(group: Group, op: str, x, topk_idx, topk_weights=None, *,
                  weighted: bool = False, x_dtypes=None) -> None:
  """Checks the tokens and their routing; `weighted`: `topk_weights` is required; `x_dtypes`:
  the dtypes `x` may have (default: the group's)."""
  c = group.config
  _check_array(op, "x", x, ndim=2, dtypes=x_dtypes or (c.dtype,), shape=("T", "H"))
  _check_array(op, "topk_idx", topk_idx, ndim=2, dtypes=(jnp.int32,), shape=("T", "K"))
  num_tokens, hidden = x.shape
  if hidden != c.hidden:
    raise ValueError(f"jax_ep.{op}: x has hidden size {hidden} (shape {x.shape}) but the group "
                     f"has hidden={c.hidden}")
  if num_tokens > c.max_tokens_per_rank:
    raise ValueError(f"jax_ep.{op}: x has {num_tokens} tokens (shape {x.shape}), more than the "
                     f"group's max_tokens_per_rank={c.max_tokens_per_rank}")
  if topk_idx.shape != (num_tokens, c.num_topk):
    raise ValueError(f"jax_ep.{op}: topk_idx must have shape [T, K] = {(num_tokens, c.num_topk)} "
                     f"(T from x, K = group num_topk), got {topk_idx.shape}")
  if weighted or topk_weights is not None:
    _check_array(op, "topk_weights", topk_weights, ndim=2,
                 dtypes=(jnp.float32, jnp.bfloat16, jnp.float16), shape=("T", "K"))
    if topk_weights.shape != topk_idx.shape:
      raise ValueError(f"jax_ep.{op}: topk_weights shape {topk_weights.shape} must equal "
                       f"topk_idx shape {topk_idx.shape}")


def _shard_name(group: Group):
  """A traced description of this shard for messages: its EP rank and any other mesh axes'
  coordinates bound here (data axes beside the EP axis)."""
  names, coords = ["rank"], [jax.lax.axis_index(group.axis_name)]
  for axis in group.mesh.axis_names:
    if axis == group.axis_name:
      continue
    try:
      coords.append(jax.lax.axis_index(axis))
      names.append(axis)
    except NameError:  # an axis the enclosing shard_map does not bind
      pass
  return names, jnp.stack(coords)


def _strict_check(group: Group, num_dropped):
  """Strict groups: hands every shard's drop count to the group's status on the host."""
  if not group.strict:
    return num_dropped
  status, capacity = group._status, group.capacity
  padding = alignment_padding(group.num_local_experts, group.expert_alignment)
  names, coords = _shard_name(group)

  def report(coords, dropped):
    shard = " ".join(f"{n} {int(c)}" for n, c in zip(names, coords))
    status.strict_dispatch(shard, int(dropped), capacity, padding)
  # A debug callback (not an io_callback), so that strict groups also work under
  # `jax.checkpoint`; it only records, so running again (remat, vmap) changes nothing.
  jax.debug.callback(report, coords, num_dropped)
  return num_dropped


def _check_x_scales(group: Group, x, x_scales):
  """With an fp8 `wire_format`: whether `x` comes quantised (float8_e4m3fn, with `x_scales` of
  the format's shape and dtype) or in the group's dtype (quantised by dispatch); a PLAIN group
  takes no `x_scales`."""
  c = group.config
  fmt = c.wire_format
  if not fmt.is_fp8:
    if x_scales is not None:
      raise ValueError(f"jax_ep.dispatch: x_scales is taken by a group whose wire_format is an "
                       f"fp8 jax_ep.RowFormat (FP8, FP8_POW2_SCALES, FP8_UE8M0); {group!r} "
                       f"dispatches PLAIN rows in {c.dtype}: pass x alone")
    return
  e4m3 = np.dtype(jnp.float8_e4m3fn)
  if np.dtype(x.dtype) != e4m3:
    if x_scales is not None:
      raise TypeError(f"jax_ep.dispatch: x_scales comes with float8_e4m3fn rows x; x has dtype "
                      f"{x.dtype} (the group's {c.dtype}: dispatch quantises it itself, pass "
                      f"no x_scales)")
    return
  shape, dtype = fp8_scales_shape(fmt, x.shape[0], c.hidden)
  spelled = "[T, H/512] int32" if fmt.ue8m0 else "[T, H/128] float32"
  if x_scales is None:
    raise TypeError(f"jax_ep.dispatch: float8_e4m3fn rows x need their scales: pass x_scales "
                    f"{spelled} = {shape} (wire_format={fmt})")
  if not hasattr(x_scales, "shape") or not hasattr(x_scales, "dtype"):
    raise TypeError(f"jax_ep.dispatch: x_scales must be an array {spelled}, got "
                    f"{type(x_scales).__name__}")
  if np.dtype(x_scales.dtype) != dtype:
    raise TypeError(f"jax_ep.dispatch: x_scales must have dtype {dtype} (wire_format={fmt}: "
                    f"{spelled}), got {x_scales.dtype}")
  if tuple(x_scales.shape) != shape:
    raise ValueError(f"jax_ep.dispatch: x_scales must have shape {spelled} = {shape} (T from x, "
                     f"wire_format={fmt}), got {tuple(x_scales.shape)}")


def dispatch(group: Group, x, topk_idx, topk_weights, *, x_scales=None):
  """Sends each token to the ranks that own its experts, grouped for a grouped GEMM.

  Args:
    group: the `Group`.
    x: `[T, H]` activations in the group's dtype, `T <= max_tokens_per_rank`. With an fp8
      `wire_format` (`jax_ep.Group`) also float8_e4m3fn rows already quantised by the caller,
      with their `x_scales`; rows in the group's dtype are quantised here, once per token.
    topk_idx: `[T, K]` int32 expert ids in `[0, E)`, or -1 for a slot that selects nothing.
      Ids outside `[-1, E)` are treated as -1 and counted in `num_invalid`. Slots of one token
      that name the same expert are merged into one row whose weight is the sum of theirs
      (`merge_duplicate_slots`): combine gives the same result, each such slot's weight
      gradient is the dot product with that one row, and the default capacity never drops.
    topk_weights: `[T, K]` float32 router weights, kept in the handle for `combine` (bf16 and
      f16 weights are accepted and cast to float32 first; their gradient comes back in their
      dtype).
    x_scales: with float8_e4m3fn `x` on an fp8 group only: `[T, H/128]` float32 (row `t`
      stands for `x[t]` times its scales, one per 128 channels), or `[T, H/512]` int32 UE8M0
      exponents for `RowFormat.FP8_UE8M0`. Sent as given.

  Returns:
    `(DispatchResult, Handle)`. Differentiable in `x` (and, through combine, in topk_weights).
    `T = 0` is allowed: nothing moves (every rank has the same static `T`). With an fp8
    `wire_format`, `recv.x` is float8_e4m3fn with `recv.scales`; the gradient passes straight
    through the quantisation: `recv.x`'s cotangent is taken in the group's dtype as the
    cotangent of the rows it stands for (what `jax_ep.dequantize` gives), and `x`'s is its
    unweighted combine, in the group's dtype (also for e4m3 `x`; `x_scales` get none).
  """
  _check_group(group, "dispatch")
  c = group.config
  fp8 = c.wire_format.is_fp8
  _check_tokens(group, "dispatch", x, topk_idx, topk_weights, weighted=True,
                x_dtypes=(c.dtype, jnp.float8_e4m3fn) if fp8 else None)
  _check_x_scales(group, x, x_scales)
  topk_weights = topk_weights.astype(jnp.float32)
  if x.shape[0] == 0:
    # Shapes are static and equal on every rank, so no rank has a token: nothing moves, and no
    # rank issues a communication op (which keeps the groups' call counts in step).
    zero = jnp.zeros((), jnp.int32)
    no_rows = jnp.zeros((c.num_local_experts,), jnp.int32)
    rows = jnp.zeros((c.capacity, c.hidden), jnp.float8_e4m3fn if fp8 else c.dtype)
    scales = None
    if fp8:
      scales = jnp.zeros(*fp8_scales_shape(c.wire_format, c.capacity, c.hidden))
    recv = DispatchResult(rows, no_rows, zero, zero, no_rows, scales)
    # Typed like every other call's results (varying wherever the inputs do).
    recv = vary_like_operands(recv, (x, topk_idx, topk_weights))
    return recv, Handle((), topk_weights, _origin(group))
  topk_idx, topk_weights = merge_duplicate_slots(topk_idx, topk_weights, c.num_experts)
  scales = None
  if fp8:
    recv_x, scales, group_sizes, num_dropped, num_invalid, layout = primitives.dispatch_fp8(
        group.backend, x, x_scales, topk_idx, topk_weights)
  else:
    recv_x, group_sizes, num_dropped, num_invalid, layout = primitives.dispatch(
        group.backend, x, topk_idx, topk_weights)
  num_dropped = _strict_check(group, num_dropped)
  offsets = group_offsets(group_sizes, c.expert_alignment, c.capacity)
  return (DispatchResult(recv_x, group_sizes, num_dropped, num_invalid, offsets, scales),
          Handle(layout, topk_weights, _origin(group)))


def quantize(x, row_format=RowFormat.FP8):
  """Rows as an fp8 dispatch sends them, for callers that quantise before `dispatch(...,
  x_scales=...)`: each row of `x` per 128 channels to float8_e4m3fn with `scale = amax / 448`
  (1 for an all-zero block; rounded up to a power of two with FP8_POW2_SCALES and FP8_UE8M0),
  the rounding of both dispatch modes.

  Args:
    x: `[..., H]` bfloat16, float16 or float32, `H % 128 == 0` (`H % 512` with FP8_UE8M0).
    row_format: an fp8 `jax_ep.RowFormat` (or its value or name), default FP8.

  Returns:
    `(q [..., H] float8_e4m3fn, scales)`: `[..., H/128]` float32, or `[..., H/512]` int32 UE8M0
    exponents with FP8_UE8M0. Differentiable straight through: `q`'s cotangent (taken in any
    float dtype, as `dispatch` gives it) comes back as `x`'s, in `x`'s dtype; the scales' is
    dropped.
  """
  where = "jax_ep.quantize"
  fmt = as_row_format(row_format, where)
  if not fmt.is_fp8:
    raise ValueError(f"{where}: row_format must be an fp8 jax_ep.RowFormat (FP8, "
                     f"FP8_POW2_SCALES, FP8_UE8M0), got {fmt}")
  if not hasattr(x, "shape") or x.ndim < 1:
    raise TypeError(f"{where}: x must be an array [..., H], got {type(x).__name__}")
  if np.dtype(x.dtype) not in DTYPES:
    raise TypeError(f"{where}: x must have dtype bfloat16, float16 or float32, got {x.dtype}")
  check_fp8_hidden(fmt, x.shape[-1], where, "row_format")
  return primitives.quantize(x, fmt)


def dequantize(x, scales, dtype=jnp.bfloat16, *, group_sizes=None, group_offsets=None):
  """fp8 rows in `dtype`: `x` `[..., H]` float8_e4m3fn times its `scales`, one per 128
  channels, rounded once to `dtype`.

  Args:
    x: `[..., H]` float8_e4m3fn (`DispatchResult.x` of an fp8 group, or
      `LowLatencyResult.x`), `H % 128 == 0`.
    scales: `[..., H/128]` float32, or `[..., H/512]` int32 UE8M0 exponents (four to a word,
      `RowFormat.FP8_UE8M0`).
    dtype: the result's dtype (the group's, bfloat16 by default).
    group_sizes: optional `[L]` int32 with `x` `[rows, H]` (`DispatchResult.group_sizes`):
      only the rows inside the groups are asked for. The rows outside them are unspecified in
      the result (on Hopper GPUs jax_ep's kernel does not write them: a dispatch's worst-case
      capacity then costs no pass over its padding), as in `DispatchResult.x`.
    group_offsets: optional `[L]` int32 with `group_sizes`: where each group starts
      (`DispatchResult.group_offsets`); without it the groups follow each other from row 0.

  Returns:
    `[..., H]` in `dtype`. Differentiable: the cotangent passes straight through to `x`, in
    `dtype` (the rows' cotangent `jax_ep.dispatch` takes), and `scales` get none.
  """
  where = "jax_ep.dequantize"
  if not hasattr(x, "shape") or np.dtype(x.dtype) != np.dtype(jnp.float8_e4m3fn):
    raise TypeError(f"{where}: x must be a float8_e4m3fn array [..., H], got "
                    f"{getattr(x, 'dtype', type(x).__name__)}")
  if x.ndim < 1 or x.shape[-1] % 128:
    raise ValueError(f"{where}: x must have a last dimension H that is a multiple of 128 (one "
                     f"scale per 128 channels), got shape {x.shape}")
  if not hasattr(scales, "shape") or np.dtype(scales.dtype) not in (np.dtype(np.float32),
                                                                     np.dtype(np.int32)):
    raise TypeError(f"{where}: scales must be a float32 [..., H/128] or int32 (UE8M0) "
                    f"[..., H/512] array, got {getattr(scales, 'dtype', type(scales).__name__)}")
  ue8m0 = np.dtype(scales.dtype) == np.dtype(np.int32)
  per = 512 if ue8m0 else 128
  want = (*x.shape[:-1], x.shape[-1] // per)
  if x.shape[-1] % per or tuple(scales.shape) != want:
    spelled = "[..., H/512] int32" if ue8m0 else "[..., H/128] float32"
    raise ValueError(f"{where}: scales must have shape {spelled} = {want} for x of shape "
                     f"{x.shape}, got {tuple(scales.shape)}")
  if group_offsets is not None and group_sizes is None:
    raise ValueError(f"{where}: group_offsets goes with group_sizes; pass both or neither")
  if group_sizes is not None:
    if x.ndim != 2:
      raise ValueError(f"{where}: group_sizes asks for the rows of x [rows, H] inside the "
                       f"groups; x has shape {x.shape}")
    for name, a in (("group_sizes", group_sizes), ("group_offsets", group_offsets)):
      if a is None:
        continue
      if not hasattr(a, "shape") or a.ndim != 1 or np.dtype(a.dtype) != np.dtype(np.int32):
        raise TypeError(f"{where}: {name} must be an int32 array [L], got "
                        f"{getattr(a, 'dtype', type(a).__name__)} of shape "
                        f"{getattr(a, 'shape', None)}")
    if group_offsets is not None and group_offsets.shape != group_sizes.shape:
      raise ValueError(f"{where}: group_offsets must have group_sizes' shape "
                       f"{tuple(group_sizes.shape)}, got {tuple(group_offsets.shape)}")
  kernel = None
  if group_sizes is not None:
    # The rows inside the groups alone: jax_ep's kernel where it runs (its row blocks divide
    # the rows); XLA's pass over every row elsewhere.
    if quantize_kernel.rows_per_program(x.shape[0]) is not None and experts_configs.on_hopper():
      kernel = quantize_kernel.dequantize_row_blocks
  return primitives.dequantize(x, scales, check_dtype(dtype, where), group_sizes,
                               group_offsets, kernel)


def combine(group: Group, expert_out, handle: Handle, *, weighted: bool = True):
  """Brings expert outputs home and reduces them with the router weights.

  Args:
    group: the `Group` used for `dispatch`.
    expert_out: `[capacity, H]` in the group's dtype, row-aligned with `DispatchResult.x`.
    handle: the `Handle` from `dispatch`.
    weighted: when False all weights are one (the transpose of `dispatch`).

  Returns:
    `[T, H]`: `out[t] = sum_k w[t, k] * expert_out[row(t, k)]` over kept slots, fp32 accumulation.
  """
  _check_group(group, "combine")
  c = group.config
  _check_array("combine", "expert_out", expert_out, ndim=2, dtypes=(c.dtype,),
               shape=("capacity", "H"))
  if expert_out.shape != (c.capacity, c.hidden):
    raise ValueError(f"jax_ep.combine: expert_out must have shape [capacity, H] = "
                     f"{(c.capacity, c.hidden)}, got {expert_out.shape}")
  if not isinstance(handle, Handle):
    raise TypeError(f"jax_ep.combine: handle must be the Handle returned by jax_ep.dispatch, "
                    f"got {type(handle).__name__}")
  _check_origin(group, "combine", handle.origin, "dispatch")
  if handle.topk_weights.shape[0] == 0:  # see dispatch: no rank has a token
    return vary_like_operands(jnp.zeros((0, c.hidden), c.dtype),
                              (expert_out, handle.topk_weights))
  return primitives.combine(group.backend, expert_out, handle.layout,
                            handle.topk_weights if weighted else None)
