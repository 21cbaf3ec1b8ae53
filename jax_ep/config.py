"""Static configuration shared by every layer of jax_ep (Python side)."""

from __future__ import annotations

import dataclasses
import enum
import operator

import jax.numpy as jnp
import numpy as np

# The activation dtypes a group carries.
DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


class RowFormat(enum.Enum):
  """How a dispatch sends and returns its rows: the low-latency dispatch's per-call
  `row_format` (`jax_ep.low_latency_dispatch`) and the high-throughput dispatch's per-group
  `wire_format` (`jax_ep.Group(..., wire_format=...)`, whose `scales` are `[capacity, H/128]`,
  or `[capacity, H/512]` int32 with FP8_UE8M0).

  The fp8 formats quantise each token per block of 128 channels to float8_e4m3fn with
  `scale = amax / 448` of the block (1 for an all-zero block), `q = e4m3(x / scale)`; they need
  `H % 128 == 0` and have no gradient on the cuda backend. The kernels' `low_latency::RowFormat`
  (`kPlain`, `kFp8`, `kFp8PowerOfTwo`, plus the `ue8m0` attribute) is the same choice.

  Members:
    PLAIN: rows in the activations' dtype (the group's: bf16, f16 or f32); no scales.
    FP8: float8_e4m3fn rows; `scales` `[L, R*T_max, H/128]` float32.
    FP8_POW2_SCALES: as FP8, every scale rounded up to a power of two.
    FP8_UE8M0: as FP8_POW2_SCALES, the scales returned as UE8M0 exponents (`2^(e - 127)`),
      four per int32, the first channel block in the lowest byte: `scales`
      `[L, R*T_max, H/512]` int32 (`H % 512 == 0`).
  """

  PLAIN = "plain"
  FP8 = "fp8"
  FP8_POW2_SCALES = "fp8_pow2_scales"
  FP8_UE8M0 = "fp8_ue8m0"

  @property
  def is_fp8(self) -> bool:
    return self is not RowFormat.PLAIN

  @property
  def pow2_scales(self) -> bool:
    """Whether every scale is a power of two (FP8_POW2_SCALES, FP8_UE8M0)."""
    return self in (RowFormat.FP8_POW2_SCALES, RowFormat.FP8_UE8M0)

  @property
  def ue8m0(self) -> bool:
    return self is RowFormat.FP8_UE8M0


def as_row_format(row_format, where: str, name: str = "row_format") -> RowFormat:
  """`row_format` as a `RowFormat`: a member, or its value or name as a string (any case);
  anything else raises an error that names `where` and the argument `name`."""
  if isinstance(row_format, RowFormat):
    return row_format
  members = ", ".join(f"RowFormat.{m.name}" for m in RowFormat)
  if isinstance(row_format, str):
    for member in RowFormat:
      if row_format.lower() in (member.value, member.name.lower()):
        return member
    raise ValueError(f"{where}: {name} must be one of {members}, got {row_format!r}")
  raise TypeError(f"{where}: {name} must be a jax_ep.RowFormat ({members}), got "
                  f"{row_format!r} of type {type(row_format).__name__}")


@dataclasses.dataclass(frozen=True)
class EPConfig:
  """Everything a backend needs to know about a group, all static (hashable, trace-time).

  Attributes:
    axis_name: the mesh axis the EP group spans.
    num_ranks: `R`, the size of that axis.
    num_experts: `E`; `num_local_experts` = `E / R`.
    num_topk: `K`.
    hidden: `H`.
    max_tokens_per_rank: `T_max`; calls may pass any `T <= T_max`.
    dtype: activation dtype (numpy dtype of bf16, f16 or f32).
    capacity: rows of the high-throughput receive buffer per rank.
    strict: raise at run time when any row is dropped.
    expert_alignment: `A`: each local expert's rows of the high-throughput receive buffer start
      at a multiple of it (1: the experts' rows follow each other without gaps).
    buffer_factor: the factor `capacity` was derived from (`jax_ep.capacity_from_buffer_factor`),
      or None when it was given in rows or left at the default. Informational: every layer
      reads `capacity`, so it takes no part in equality, hashing or the fingerprint (two
      processes that reach the same rows by different arguments build the same buffers).
    wire_format: how the high-throughput dispatch sends and returns its rows (`RowFormat`;
      PLAIN: the activations' dtype; an fp8 member: e4m3 rows with their scales).
  """

  axis_name: str
  num_ranks: int
  num_experts: int
  num_topk: int
  hidden: int
  max_tokens_per_rank: int
  dtype: np.dtype
  capacity: int
  strict: bool = False
  buffer_factor: float | None = dataclasses.field(default=None, compare=False)
  expert_alignment: int = 1
  wire_format: RowFormat = RowFormat.PLAIN

  @property
  def num_local_experts(self) -> int:
    return self.num_experts // self.num_ranks

  @property
  def low_latency_slab(self) -> int:
    """Rows per local expert in the low-latency receive buffer: `R * T_max`."""
    return self.num_ranks * self.max_tokens_per_rank

  def fingerprint(self) -> dict[str, object]:
    """Fields that every process of a group must agree on."""
    return dict(axis_name=self.axis_name, num_ranks=self.num_ranks, num_experts=self.num_experts,
                num_topk=self.num_topk, hidden=self.hidden,
                max_tokens_per_rank=self.max_tokens_per_rank, dtype=str(np.dtype(self.dtype)),
                capacity=self.capacity, strict=self.strict,
                expert_alignment=self.expert_alignment, wire_format=self.wire_format.value)


def check_fp8_hidden(fmt: RowFormat, hidden: int, where: str, name: str) -> None:
  """Raises unless `hidden` fits the fp8 `fmt` (`name=fmt` in the message): one scale per 128
  channels, and four UE8M0 exponents to an int32 (512 channels)."""
  if fmt.is_fp8 and hidden % 128:
    raise ValueError(f"{where}: {name}={fmt} needs hidden to be a multiple of 128 (one scale "
                     f"per 128 channels), got hidden={hidden}")
  if fmt.ue8m0 and hidden % 512:
    raise ValueError(f"{where}: {name}={fmt} needs hidden to be a multiple of 512 (four "
                     f"scales per int32), got hidden={hidden}")


def fp8_scales_shape(fmt: RowFormat, rows: int, hidden: int) -> tuple[tuple[int, int], np.dtype]:
  """`(shape, dtype)` of the scales of `rows` fp8 rows of `hidden` channels in `fmt`:
  `[rows, H/128]` float32, or `[rows, H/512]` int32 (UE8M0 exponents, four to a word)."""
  if fmt.ue8m0:
    return (rows, hidden // 512), np.dtype(np.int32)
  return (rows, hidden // 128), np.dtype(np.float32)


def positive_int(name: str, value, where: str = "jax_ep.Group") -> int:
  """`value` as a positive int, or an error naming `name` and its value."""
  if isinstance(value, bool):  # an int to Python, never a count here
    raise TypeError(f"{where}: {name} must be an int, got {value!r}")
  try:
    value = operator.index(value)
  except TypeError:
    raise TypeError(f"{where}: {name} must be an int, got {value!r} "
                    f"({type(value).__name__})") from None
  if value <= 0:
    raise ValueError(f"{where}: {name} must be positive, got {value}")
  return value


def check_dtype(dtype, where: str = "jax_ep.Group") -> np.dtype:
  """`dtype` as a numpy dtype, or a `TypeError` naming the dtypes a group takes."""
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    raise TypeError(f"{where}: dtype must be one of bfloat16, float16, float32; "
                    f"got {dtype!r}") from None
  if dtype not in DTYPES:
    raise TypeError(f"{where}: dtype must be one of bfloat16, float16, float32; got {dtype}")
  return dtype


def alignment_padding(num_local_experts: int, expert_alignment: int = 1) -> int:
  """Rows `expert_alignment` can add to a rank's receive buffer: `L * (A - 1)`.

  Each expert's rows start at a multiple of `A`, so the gap before an expert (after the one
  before it) is at most `A - 1` rows; counting the last expert's gap to the next multiple too,
  every expert's rows rounded up to whole multiples of `A` lie inside the buffer.
  """
  return num_local_experts * (expert_alignment - 1)


# The largest `expert_alignment` a group takes (the cuda kernels' `kMaxExpertAlignment`,
# ffi/kernels/ep_common.h): far above any row tile, and small enough that a rank's rows plus
# the padding stay inside int32 row indices at every size the kernels take.
MAX_EXPERT_ALIGNMENT = 1 << 16


def check_expert_alignment(expert_alignment, where: str = "jax_ep.Group") -> int:
  """`expert_alignment` as an int in `[1, MAX_EXPERT_ALIGNMENT]`, or an error naming it."""
  if isinstance(expert_alignment, bool):
    raise TypeError(f"{where}: expert_alignment must be a positive int (rows), got "
                    f"{expert_alignment!r}")
  try:
    value = operator.index(expert_alignment)
  except TypeError:
    raise TypeError(f"{where}: expert_alignment must be a positive int (rows), got "
                    f"{expert_alignment!r} ({type(expert_alignment).__name__})") from None
  if not 1 <= value <= MAX_EXPERT_ALIGNMENT:
    raise ValueError(f"{where}: expert_alignment must be an int in [1, {MAX_EXPERT_ALIGNMENT}] "
                     f"(1: no padding; a grouped GEMM's row tile, e.g. 64 or 128), got "
                     f"{expert_alignment!r}")
  return value


def default_capacity(num_ranks: int, max_tokens_per_rank: int, num_topk: int,
                     num_local_experts: int, expert_alignment: int = 1) -> int:
  """The most rows one rank can need: `R * T_max * min(K, L) + L * (A - 1)`, the worst case.

  Each of the `R * T_max` tokens that can reach a rank brings at most `min(K, L)` rows there:
  its slots that name the same expert share one row (`jax_ep.dispatch`), so it has at most one
  row per local expert and at most one per slot. With `expert_alignment=A > 1` every expert's
  rows start at a multiple of `A`, which adds at most `A - 1` rows of padding per expert
  (`alignment_padding`). A group with this capacity never drops.
  """
  return (num_ranks * max_tokens_per_rank * min(num_topk, num_local_experts)
          + alignment_padding(num_local_experts, expert_alignment))
