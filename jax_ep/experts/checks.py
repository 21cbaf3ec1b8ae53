"""The rules a layout of groups follows, checked at trace time where the values are known and
on the device (`checkify`) inside `check_traced_groups`."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def _known(value) -> np.ndarray | None:
  """`value`'s numbers where they are known while tracing (an eager call, or a constant under
  `jit`), else None."""
  if isinstance(value, jax.core.Tracer) or not getattr(value, "is_fully_addressable", True):
    return None
  return np.asarray(value)


def _group_rules(rows: int, sizes, offsets, xp, where: str):
  """`(holds, message, *values)` for each rule the groups over `rows` rows follow (`offsets`
  None: the groups follow each other from row 0), on numpy values (`xp=np`, checked at once)
  or traced ones (`xp=jnp`, checked by `checkify`): one list of rules, one wording."""
  sizes_rule = (xp.all(sizes >= 0), f"{where}: group_sizes must be >= 0, got {{}}", sizes)
  if offsets is None:
    return (sizes_rule,
            (xp.sum(sizes) <= rows, f"{where}: group_sizes must sum to at most x's {rows} rows, "
             f"got {{}} (sum {{}})", sizes, xp.sum(sizes)))
  ends = offsets + sizes
  return (
      sizes_rule,
      (xp.all(offsets >= 0), f"{where}: group_offsets must be >= 0, got {{}}", offsets),
      (xp.all(ends <= rows), f"{where}: every group must end inside x's {rows} rows, got "
       f"group_offsets + group_sizes = {{}}", ends),
      (xp.all(offsets[1:] >= ends[:-1]), f"{where}: the groups must be ascending and disjoint "
       f"(group_offsets[g] >= group_offsets[g-1] + group_sizes[g-1]), got group_offsets = {{}} "
       f"and group_offsets + group_sizes = {{}}", offsets, ends),
  )


# Whether traces check traced group values (`check_traced_groups`).
_CHECK_TRACED = contextvars.ContextVar("jax_ep_check_traced_groups", default=False)


@contextlib.contextmanager
def check_traced_groups():
  """Within the block, `grouped_matmul` (and `expert_mlp`, the layer's experts) traced with
  `group_sizes` / `group_offsets` whose values are unknown until the program runs checks them
  on the device by the rules known values are checked by at trace time (`checkify.check`: a few
  `[G]` reductions). Trace the program inside the block and run it under
  `jax.experimental.checkify.checkify(f, errors=checkify.user_checks)`: the error it returns
  names the rule that failed and the values (`jax_ep.moe_mlp` too, on a mesh whose axes are
  Auto: checkify does not take `shard_map` over Explicit axes). A function jax traced before
  the block keeps that trace (jax's cache does not see the block): trace a function of its own
  inside. Off by default: a program with checks carries checkify's effect, which needs
  `checkify.checkify` to run and which `jax.export` cannot serialise."""
  token = _CHECK_TRACED.set(True)
  try:
    yield
  finally:
    _CHECK_TRACED.reset(token)


def check_groups(rows: int, group_sizes, group_offsets,
                 where: str = "jax_ep.grouped_matmul") -> None:
  """Raises where known `group_sizes` / `group_offsets` (None: none given) break the layout
  (a negative size, a group past the rows, overlapping groups): the product would silently
  take other rows. Traced values are checked on the device inside `check_traced_groups`."""
  if np.ndim(group_sizes) != 1 or (group_offsets is not None
                                   and np.shape(group_offsets) != np.shape(group_sizes)):
    return  # shapes the caller's own checks refuse by name
  sizes = _known(group_sizes)
  offsets = None if group_offsets is None else _known(group_offsets)
  if sizes is None or (group_offsets is not None and offsets is None):
    if _CHECK_TRACED.get():
      for holds, message, *values in _group_rules(rows, group_sizes, group_offsets, jnp, where):
        checkify.check(holds, message, *values)
    return
  for holds, message, *values in _group_rules(rows, sizes, offsets, np, where):
    if not holds:
      raise ValueError(message.format(*(np.asarray(v).tolist() for v in values)))


