"""Static configuration shared by every layer of jax_ep (Python side)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

# The activation dtypes a group carries.
DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


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
    capacity_factor: the factor `capacity` was derived from (`jax_ep.capacity_from_factor`),
      or None when it was given in rows or left at the default. Informational: every layer
      reads `capacity`, so it takes no part in equality, hashing or the fingerprint (two
      processes that reach the same rows by different arguments build the same buffers).
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
  capacity_factor: float | None = dataclasses.field(default=None, compare=False)

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
                capacity=self.capacity, strict=self.strict)


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


def default_capacity(num_ranks: int, max_tokens_per_rank: int, num_topk: int,
                     num_local_experts: int) -> int:
  """The most rows one rank can receive: `R * T_max * min(K, L)`, the exact worst case.

  Each of the `R * T_max` tokens that can reach a rank brings at most `min(K, L)` rows there:
  its slots that name the same expert share one row (`jax_ep.dispatch`), so it has at most one
  row per local expert and at most one per slot. A group with this capacity never drops.
  """
  return num_ranks * max_tokens_per_rank * min(num_topk, num_local_experts)
