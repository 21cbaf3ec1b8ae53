"""How many rows and bytes a group configuration takes, before anything is allocated: the
receive capacity (`capacity`, or `buffer_factor`), the buffers, and what the expert layer keeps
for its backward.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import numbers
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.backends import registry
from jax_ep.config import (EPConfig, RowFormat, alignment_padding, as_row_format, check_dtype,
                            check_expert_alignment, check_fp8_hidden, default_capacity,
                            positive_int)
from jax_ep.experts.mlp import fused_mlp_impl, fused_saved_bytes
from jax_ep.experts.mlp_fp8 import fp8_saved_bytes, fp8_weight_bytes
from jax_ep.gmm import ROW_TILE
from jax_ep.routing import merge_duplicate_slots

# Expert FFN activations `memory_bytes` sizes: (the function, whether it is gated). A gated one
# multiplies the activation of a gate product by an up product (two `[rows, F]` GEMMs from the
# same rows); a plain one applies the activation to one product. `jax_ep.moe_mlp` runs swiglu.
ACTIVATIONS = {
    "swiglu": (jax.nn.silu, True),
    "geglu": (jax.nn.gelu, True),  # jax.nn.gelu's default, the tanh approximation
    "gelu": (jax.nn.gelu, False),
    "silu": (jax.nn.silu, False),
}


def check_buffer_factor(buffer_factor, where: str = "jax_ep.Group") -> float:
  """`buffer_factor` as a float, or an error naming it and its value."""
  if isinstance(buffer_factor, bool) or not isinstance(buffer_factor, numbers.Real):
    raise TypeError(f"{where}: buffer_factor must be a positive finite number, got "
                    f"{buffer_factor!r} ({type(buffer_factor).__name__})")
  value = float(buffer_factor)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{where}: buffer_factor must be a positive finite number, got "
                     f"{buffer_factor!r}")
  return value


def refuse_capacity_factor(capacity_factor, where: str) -> None:
  """Raises where a caller passed `capacity_factor`, a name that means two different things in
  other frameworks, saying which of jax_ep's two arguments gives which."""
  if capacity_factor is None:
    return
  raise TypeError(
      f"{where}: jax_ep takes no capacity_factor (got {capacity_factor!r}); it has two arguments "
      f"for the two things the name means elsewhere. buffer_factor=f sizes each rank's receive "
      f"buffer, ceil(f * T_max * K) rows, f times what a rank receives under balanced routing, "
      f"and drops only what does not fit there (MaxText's ragged_buffer_factor). "
      f"jax_ep.limit_expert_capacity(topk_idx, num_experts, capacity_factor=f, "
      f"sequence_length=S) caps the slots each expert takes from each sequence, "
      f"max(ceil(S * K / E) * f, f), before dispatch (MaxText's and GShard's capacity_factor, "
      f"which drops more). docs/memory.md compares them")


def capacity_from_buffer_factor(buffer_factor: float, num_ranks: int,
                                max_tokens_per_rank: int, num_topk: int,
                                num_local_experts: int, expert_alignment: int = 1) -> int:
  """Receive rows for `buffer_factor=f`: `ceil(f * T_max * K)` plus the padding
  `expert_alignment=A` can add (`L * (A - 1)`, `jax_ep.config.alignment_padding`), rounded up
  to a multiple of the grouped GEMM's row tile (`jax_ep.gmm.ROW_TILE`), and never more than the
  worst case `default_capacity(R, T_max, K, L, A)`.

  `T_max * K` is what one rank receives on average when the router spreads the `R * T_max * K`
  slots evenly over the `R` ranks, so `f` is the headroom over a perfectly balanced step
  (`f = 1.25`: a quarter more). Whole tiles cost nothing the GEMM would not spend anyway; the
  clamp holds because no rank can ever receive more than the worst case, so rows past it would
  be memory that is never written. `f` counts as the decimal it prints as (1.1 is 11/10), so
  the rounding never adds a row for a float's last bit.
  """
  exact = fractions.Fraction(repr(float(buffer_factor))) * max_tokens_per_rank * num_topk
  rows = math.ceil(exact) + alignment_padding(num_local_experts, expert_alignment)
  rows = -(-rows // ROW_TILE) * ROW_TILE
  return min(rows, default_capacity(num_ranks, max_tokens_per_rank, num_topk,
                                    num_local_experts, expert_alignment))


def resolve_capacity(capacity, buffer_factor, num_ranks: int, max_tokens_per_rank: int,
                     num_topk: int, num_local_experts: int,
                     where: str = "jax_ep.Group",
                     expert_alignment: int = 1) -> tuple[int, float | None]:
  """`(capacity in rows, buffer_factor or None)` from the arguments a user passed: at most
  one of them; neither gives the worst case, which never drops. `expert_alignment` adds its
  padding to the worst case and to the factor's rows; a capacity given in rows is taken as
  it is."""
  worst = default_capacity(num_ranks, max_tokens_per_rank, num_topk, num_local_experts,
                           expert_alignment)
  if capacity is not None and buffer_factor is not None:
    raise ValueError(f"{where}: pass capacity or buffer_factor, not both (got capacity="
                     f"{capacity!r}, buffer_factor={buffer_factor!r})")
  if buffer_factor is not None:
    buffer_factor = check_buffer_factor(buffer_factor, where)
    return capacity_from_buffer_factor(buffer_factor, num_ranks, max_tokens_per_rank,
                                       num_topk, num_local_experts,
                                       expert_alignment), buffer_factor
  if capacity is None:
    return worst, None
  try:
    capacity = operator.index(capacity)
  except TypeError:
    raise TypeError(f"{where}: capacity must be an int (rows), got {capacity!r} "
                    f"({type(capacity).__name__}); buffer_factor takes a fraction") from None
  if capacity <= 0:
    # A zero-row buffer would drop every row of every step; nobody means that.
    padding = " + L * (A - 1)" if expert_alignment > 1 else ""
    raise ValueError(f"{where}: capacity must be positive, got {capacity} (leave it None for "
                     f"the worst case, R * T_max * min(K, L){padding} = {worst} rows, which "
                     f"never drops)")
  return capacity, None


def check_configuration(where: str, axis_name: str, *, num_ranks: int, num_experts, num_topk,
                        hidden, max_tokens_per_rank, dtype, capacity, buffer_factor,
                        expert_alignment, strict: bool = False,
                        ranks: str | None = None, wire_format=None) -> EPConfig:
  """The `EPConfig` of a group's arguments, or the error that names the first one a group
  cannot take: the one rule `jax_ep.Group` and `jax_ep.memory_bytes` both apply, so that a
  configuration is sized only where it can be created. `ranks` says where `num_ranks` came
  from in messages (default `num_ranks=R`, the argument). `wire_format`: the high-throughput
  dispatch's `RowFormat` (a member or its name; None: PLAIN)."""
  num_ranks = positive_int("num_ranks", num_ranks, where)
  ranks = ranks or f"num_ranks={num_ranks}"
  num_experts = positive_int("num_experts", num_experts, where)
  num_topk = positive_int("num_topk", num_topk, where)
  hidden = positive_int("hidden", hidden, where)
  max_tokens_per_rank = positive_int("max_tokens_per_rank", max_tokens_per_rank, where)
  if num_experts % num_ranks:
    raise ValueError(f"{where}: num_experts={num_experts} must be divisible by {ranks}")
  if num_topk > num_experts:
    raise ValueError(f"{where}: num_topk={num_topk} must be <= num_experts={num_experts} (a "
                     f"token selects at most every expert once)")
  dtype = check_dtype(dtype, where)
  wire_format = (RowFormat.PLAIN if wire_format is None
                 else as_row_format(wire_format, where, "wire_format"))
  check_fp8_hidden(wire_format, hidden, where, "wire_format")
  expert_alignment = check_expert_alignment(expert_alignment, where)
  capacity, buffer_factor = resolve_capacity(capacity, buffer_factor, num_ranks,
                                             max_tokens_per_rank, num_topk,
                                             num_experts // num_ranks, where=where,
                                             expert_alignment=expert_alignment)
  return EPConfig(axis_name, num_ranks, num_experts, num_topk, hidden, max_tokens_per_rank,
                  dtype, capacity, bool(strict), buffer_factor=buffer_factor,
                  expert_alignment=expert_alignment, wire_format=wire_format)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes one rank needs for a group configuration.

  Attributes:
    recv_x_bytes: the high-throughput dispatch output `[capacity, H]` (with an fp8
      `wire_format`, one byte per element plus the scales).
    handle_bytes: routing metadata kept between dispatch and combine (the largest backend's).
    low_latency_recv_bytes: the low-latency dispatch output `[L, R*T_max, H]` (bf16 or fp8 plus
      scales, whichever asked).
    workspace_bytes: transient buffers of one call (the reference's exchange blocks, or the
      kernels' scratch).
    comm_buffer_bytes: library-owned communication buffers allocated once per group.
    low_latency_buffer_bytes: the part of `comm_buffer_bytes` that the low-latency buffers take
      (two sets of `[L, R*T_max]` rows and `[T_max, K]` combine rows; cuda with
      `low_latency=True` only).
    capacity: the receive rows all of the above were sized for.
    expert_activation_bytes: what one high-throughput MoE layer (`jax_ep.moe_mlp`) keeps for
      its backward, per layer (see `memory_bytes`); None without `ffn`.
    expert_activation_bytes_remat: the same with the layer inside `jax.checkpoint`; None
      without `ffn`.
  """
  recv_x_bytes: int
  handle_bytes: int
  low_latency_recv_bytes: int
  workspace_bytes: int
  comm_buffer_bytes: int
  low_latency_buffer_bytes: int = 0
  capacity: int | None = None
  expert_activation_bytes: int | None = None
  expert_activation_bytes_remat: int | None = None

  @property
  def total_bytes(self) -> int:
    """The group's buffers and outputs. The expert activations are not in it: which of the two
    figures applies depends on whether the model rematerialises the layer."""
    return (self.recv_x_bytes + self.handle_bytes + self.low_latency_recv_bytes
            + self.workspace_bytes + self.comm_buffer_bytes)


# The backends `memory_bytes` sizes: a created group's `backend_name` ('auto' is a choice made
# when a group is created, on its devices).


def _nbytes(structs) -> int:
  return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in structs)


def _saved_bytes(fn, *args) -> int:
  """Bytes of the residuals jax's autodiff keeps for `fn`'s backward, differentiating in every
  argument: `jax.vjp` traced on abstract values (no arithmetic, nothing allocated)."""
  return _nbytes(jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]), *args))


def activation_saved_bytes(activation: str, rows: int, ffn: int, dtype) -> int:
  """What the expert FFN's activation keeps for its backward over `[rows, F]` float32 GEMM
  outputs whose result is rounded to `dtype`: jax's own differentiation rules, traced. For
  swiglu, five `[rows, F]` float32 arrays: the gate and up products, `silu(gate)`,
  `sigmoid(gate)` and its derivative `sigmoid * (1 - sigmoid)`."""
  fn, gated = ACTIVATIONS[activation]
  product = jax.ShapeDtypeStruct((rows, ffn), jnp.float32)
  if gated:
    return _saved_bytes(lambda gate, up: (fn(gate) * up).astype(dtype), product, product)
  return _saved_bytes(lambda up: fn(up).astype(dtype), product)


def _expert_mlp_saved_bytes(activation, rows, groups, hidden, ffn, dtype) -> int:
  """What `jax_ep.expert_mlp` keeps over its `[rows, F]` products, on the path this machine
  runs: the fused Hopper kernels keep the gate (and up) projections in `dtype`; the grouped
  GEMMs keep the activation's float32 residuals and the hidden activation in `dtype`."""
  if fused_mlp_impl(rows, groups, hidden, ffn, dtype, activation, probe=False)[0]:
    return fused_saved_bytes(activation, rows, ffn, dtype)
  return activation_saved_bytes(activation, rows, ffn, dtype) + rows * ffn * dtype.itemsize


def _merge_saved_bytes(num_tokens: int, num_topk: int, num_experts: int) -> int:
  """What merging duplicate slots keeps for the router weights' gradient (`[T, K, K]` and
  `[T, K]` masks), by jax's rules."""
  def residuals(topk_idx, topk_weights):
    merged = lambda w: merge_duplicate_slots(topk_idx, w, num_experts)[1]
    return jax.tree.leaves(jax.vjp(merged, topk_weights)[1])
  return _nbytes(jax.eval_shape(residuals, jax.ShapeDtypeStruct((num_tokens, num_topk), jnp.int32),
                                jax.ShapeDtypeStruct((num_tokens, num_topk), jnp.float32)))


def _check_ffn(ffn, activation) -> int:
  ffn = positive_int("ffn", ffn, "jax_ep.memory_bytes")
  if activation not in ACTIVATIONS:
    raise ValueError(f"jax_ep.memory_bytes: activation must be one of "
                     f"{', '.join(map(repr, ACTIVATIONS))}; got {activation!r}")
  return ffn


def low_latency_row_bytes(row_format: RowFormat, hidden: int, dtype) -> int:
  """Bytes of one dispatched row with its scales (either mode's `RowFormat`): `H` activations;
  fp8: `H` bytes and a float32 scale per 128 channels (`FP8_UE8M0`: one exponent byte per 128
  channels, four to an int32)."""
  if not row_format.is_fp8:
    return hidden * np.dtype(dtype).itemsize
  if row_format.ue8m0:
    return hidden + 4 * (hidden // 512)
  return hidden + 4 * (hidden // 128)


def memory_bytes(*, num_ranks: int, num_experts: int, num_topk: int, hidden: int,
                 max_tokens_per_rank: int, dtype=jnp.bfloat16, capacity: int | None = None,
                 buffer_factor: float | None = None, expert_alignment: int = 1,
                 backend: str = "reference",
                 row_format: RowFormat | str | None = None,
                 wire_format: RowFormat | str | None = None, low_latency: bool = False,
                 network: bool = False, num_hosts: int = 0, ffn: int | None = None,
                 activation: str = "swiglu", fp8: bool = False,
                 capacity_factor: None = None) -> MemoryEstimate:
  """How much memory one rank needs for this configuration, before anything is allocated.

  Args:
    num_ranks: `R`. num_experts: `E` (divisible by `R`). num_topk: `K`. hidden: `H`.
    max_tokens_per_rank: `T_max`. dtype: activation dtype.
    capacity, buffer_factor: receive rows per rank, as `jax_ep.Group` takes them (at most one;
      neither: `default_capacity`, the worst case; `capacity_factor` is refused as there).
      expert_alignment: `A`, as `jax_ep.Group` takes it: the worst case and the factor's rows grow by the padding `L * (A - 1)`, and so
      does every figure sized by the capacity. backend: 'reference' or 'cuda'. row_format:
      the low-latency rows' `jax_ep.RowFormat` (default PLAIN; fp8 formats count their scales),
      which sizes `low_latency_recv_bytes`. wire_format: the high-throughput dispatch's
      `jax_ep.RowFormat`, as `jax_ep.Group` takes it (default PLAIN): `recv_x_bytes` is
      `capacity` rows of `H` bytes plus their scales with an fp8 member (the expert layer's
      figures keep the activations' dtype). low_latency: a cuda
      group created with `low_latency=True` (its communication buffers include the low-latency
      ones).
    network: a cuda group whose ranks span `num_hosts` hosts (real or `virtual_hosts`): its
      buffer, in NVSHMEM's symmetric heap, also holds the outbox the low-latency puts read and
      the rail exchange's blocks, and each host's own group has a buffer for the
      high-throughput ops' forwarding (jax_ep/backends/hierarchical.py).
    ffn: `F`, the experts' inner size: also size what the expert layer keeps for its backward.
    activation: the experts' activation, 'swiglu' (what `jax_ep.moe_mlp` runs), 'geglu',
      'gelu' or 'silu'.
    fp8: the layer's experts in FP8 (`jax_ep.moe_mlp(..., fp8=True)`): with `ffn`, size what
      that recipe keeps (below).

  With `ffn`, `expert_activation_bytes` counts what `jax.grad` of one `jax_ep.moe_mlp` layer
  (high-throughput, routing given) keeps from its forward for its backward, besides the
  weights, with `C` = capacity, at `T = T_max`:
  - the layer input `[T, H]` (dispatch keeps it) and the routing: `handle_bytes` (metadata and
    the merged router weights, which combine keeps) plus the masks of merging duplicate slots;
  - the dispatched rows `[C, H]`, `group_sizes` and `group_offsets` `[L]` int32 each: the
    `(x, w, group_sizes, group_offsets)` residuals of the gate and up `grouped_matmul` calls
    share them (the weights are parameters, not counted);
  - on Hopper, where the experts run fused kernels (jax_ep/experts/mlp.py): the gate and up
    projections `[C, F]` in `dtype` (one for a plain activation); elsewhere the activation's
    residuals over the `[C, F]` float32 products, by jax's differentiation rules
    (`activation_saved_bytes`; swiglu: gate, up, silu(gate), sigmoid(gate) and its
    derivative, five `[C, F]` float32 arrays; a plain activation has one product), and the
    hidden activation `[C, F]` in `dtype` (the down `grouped_matmul`'s `x`);
  - the experts' output `[C, H]` in `dtype` (combine keeps it for the weights' gradient).
  These are the residuals `jax.vjp` and `jax.ad_checkpoint.print_saved_residuals` report; XLA
  may fuse the activation's elementwise ones into the backward and hold fewer, never more.
  The backward's own temporaries (cotangents of the same shapes) come on top while it runs.

  `expert_activation_bytes_remat` is the same layer inside `jax.checkpoint`: only its inputs
  stay, the layer input `[T, H]` and the routing given to it (`topk_idx` int32 and
  `topk_weights` float32, `[T, K]` each; a router inside the checkpoint recomputes them too);
  the backward recomputes the rest, so one layer's `expert_activation_bytes` exist again while
  that layer's backward runs. A model of `N` such layers keeps `N` times the remat figure plus,
  at its peak, one layer's full figure.

  With `fp8`, the experts keep instead (jax_ep/experts/mlp_fp8.py): the dispatched rows as
  e4m3 `[C, H]` bytes with float32 scales `[C, H / 128]` (quantised by an fp8 dispatch or
  after a bf16 one: the bf16 rows are not kept), the hidden activation the same way over `F`,
  and the gate (and up) projections `[C, F]` in bf16; and the per-call FP8 copy of the expert
  weights (1 byte per parameter and a float32 scale per 128 x 128 block), which the backward
  multiplies by, in both figures (under remat too: it is quantised outside the checkpoint).

  A layer of `micro_batches=n` makes `n` calls of `T / n` tokens, each keeping its own
  residuals with the whole capacity: `n` times both figures estimated at
  `max_tokens_per_rank=T / n` (under remat one micro-batch's full figure at the peak). A
  group sized for the micro-batch keeps about the unsplit layer's; one sized for `T`, `n`
  times its capacity-sized terms.
  """
  where = "jax_ep.memory_bytes"
  refuse_capacity_factor(capacity_factor, where)
  config = check_configuration(where, "ep", num_ranks=num_ranks, num_experts=num_experts,
                               num_topk=num_topk, hidden=hidden,
                               max_tokens_per_rank=max_tokens_per_rank, dtype=dtype,
                               capacity=capacity, buffer_factor=buffer_factor,
                               expert_alignment=expert_alignment, wire_format=wire_format)
  if not isinstance(fp8, bool):
    raise TypeError(f"{where}: fp8 must be a bool, got {fp8!r}")
  if backend not in registry.BACKENDS:
    raise ValueError(f"{where}: backend must be {' or '.join(map(repr, registry.BACKENDS))} "
                     f"(the group's `backend_name`); got {backend!r}")
  row_format = RowFormat.PLAIN if row_format is None else as_row_format(row_format, where)
  num_ranks, num_experts, num_topk, hidden, max_tokens_per_rank, dtype, capacity = (
      config.num_ranks, config.num_experts, config.num_topk, config.hidden,
      config.max_tokens_per_rank, config.dtype, config.capacity)
  num_local = config.num_local_experts
  t, k, r = max_tokens_per_rank, num_topk, num_ranks
  rows = capacity * hidden * dtype.itemsize  # the dispatched rows in the activations' dtype
  recv_x = capacity * low_latency_row_bytes(config.wire_format, hidden, dtype)
  handle = 4 * (t * k + r * t * k + capacity) + 4 * t * k  # routing + the weights
  slab_rows = num_local * r * t
  low_latency_rows = slab_rows * low_latency_row_bytes(row_format, hidden, dtype)
  buffers = registry.BACKENDS[backend].memory(config, low_latency=low_latency, network=network,
                                               num_hosts=num_hosts)
  saved = saved_remat = None
  if ffn is not None:
    ffn = _check_ffn(ffn, activation)
    layer_input = t * hidden * dtype.itemsize
    if fp8:
      if hidden % 128 or ffn % 128:
        raise ValueError(f"{where}: fp8=True scales blocks of 128 channels: hidden={hidden} and "
                         f"ffn={ffn} must be multiples of 128")
      experts = fp8_saved_bytes(activation, capacity, hidden, ffn)
      weights = fp8_weight_bytes(activation, num_local, hidden, ffn)
    else:
      experts = rows + _expert_mlp_saved_bytes(activation, capacity, num_local, hidden, ffn,
                                               dtype)
      weights = 0
    saved = (layer_input + handle + _merge_saved_bytes(t, k, num_experts) + 2 * 4 * num_local
             + experts + weights + capacity * hidden * dtype.itemsize)
    saved_remat = layer_input + t * k * (4 + 4) + weights
  return MemoryEstimate(recv_x, handle, low_latency_rows, buffers.workspace_bytes,
                        comm_buffer_bytes=buffers.comm_buffer_bytes,
                        low_latency_buffer_bytes=buffers.low_latency_buffer_bytes,
                        capacity=capacity, expert_activation_bytes=saved,
                        expert_activation_bytes_remat=saved_remat)
