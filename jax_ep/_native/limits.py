"""The cuda kernels' limits, read from the extension, and the checks a group is created with.

The extension exports one table (`_jax_ep_ffi.limits()`); the FFI handlers check the same
constants on every call. Checking a configuration against it when the group is created turns a
shape the kernels cannot take into an error naming the limit (or, for `backend="auto"`, into a
reason to pick the reference backend) instead of a failure inside a handler at run time.
"""

from __future__ import annotations

import dataclasses

from jax_ep._native import ffi
from jax_ep.config import EPConfig


# The send kernels' SM budget bound, `kMaxNumSms` of ffi/kernels/ep_common.h (the extension's
# `max_num_sms`; tests/test_defaults.py holds them equal): far above any GPU's multiprocessor
# count, it keeps every send kernel's grid (num_sms times its blocks per SM) inside int32 and the
# launch limits. Known without the extension, so a group checks `num_sms` on any machine.
MAX_NUM_SMS = 1024


@dataclasses.dataclass(frozen=True)
class KernelLimits:
  """Attributes:
    max_experts: experts one rank's kernels index: `E` at one rank, `E / R` across ranks.
    max_topk: `K`.
    max_slots: slots of one call: `T_max * K` at one rank, `R * T_max * K` across ranks.
    hidden_multiple: `H` must be a multiple of it (rows move as 16-byte vectors).
    max_capacity: rows of `recv_x` (int32 row indices).
    max_ranks: `R` of a native group (either transport).
    max_num_sms: the send kernels' SM budget `num_sms`.
  """
  max_experts: int
  max_topk: int
  max_slots: int
  hidden_multiple: int
  max_capacity: int
  max_ranks: int
  max_num_sms: int


def kernel_limits() -> KernelLimits | None:
  """The extension's limits, or None without the extension."""
  ext = ffi.extension()
  if ext is None:
    return None
  table = dict(ext.limits())
  return KernelLimits(**{f.name: int(table[f.name]) for f in dataclasses.fields(KernelLimits)})


def cuda_violation(config: EPConfig, limits: KernelLimits, num_sms: int) -> str | None:
  """Why the cuda kernels cannot take `config` (the first limit it breaks), or None."""
  c = config
  if c.hidden % limits.hidden_multiple:
    return (f"hidden={c.hidden} is not a multiple of {limits.hidden_multiple} (the kernels move "
            f"rows as 16-byte vectors)")
  if c.num_topk > limits.max_topk:
    return f"num_topk={c.num_topk} is above the kernels' limit of {limits.max_topk}"
  if c.capacity > limits.max_capacity:
    return f"capacity={c.capacity} is above the kernels' limit of {limits.max_capacity} rows"
  if c.num_ranks == 1:
    if c.num_experts > limits.max_experts:
      return f"num_experts={c.num_experts} is above the kernels' limit of {limits.max_experts}"
    slots = c.max_tokens_per_rank * c.num_topk
    if slots > limits.max_slots:
      return (f"max_tokens_per_rank * num_topk = {slots} slots is above the kernels' limit of "
              f"{limits.max_slots}")
    return None
  if c.num_ranks > limits.max_ranks:
    return (f"{c.num_ranks} ranks is above the kernels' limit of "
            f"{limits.max_ranks}")
  if c.num_local_experts > limits.max_experts:
    return (f"num_experts / ranks = {c.num_local_experts} local experts is above the kernels' "
            f"limit of {limits.max_experts}")
  slots = c.num_ranks * c.max_tokens_per_rank * c.num_topk
  if slots > limits.max_slots:
    return (f"ranks * max_tokens_per_rank * num_topk = {slots} received slots is above the "
            f"kernels' limit of {limits.max_slots}")
  if num_sms > limits.max_num_sms:
    return f"num_sms={num_sms} is above the limit of {limits.max_num_sms}"
  return None
