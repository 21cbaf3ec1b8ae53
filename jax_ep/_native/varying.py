"""The `shard_map` axes a value varies over (its manual axis type), and matching them.

NOTES: inside `shard_map(check_vma=True)` a value's type records the mesh axes it varies over.
XLA FFI calls produce values typed as invariant, and a custom_vjp's cotangent must have its
primal's type: these helpers make both hold.
"""

from __future__ import annotations

import jax


def varying_axes(value) -> frozenset:
  manual = getattr(jax.typeof(value), "manual_axis_type", None)
  return manual.varying if manual is not None else frozenset()


def vary_like_operands(outs, args):
  """Types `outs` as varying over every axis any of `args` varies over (a kernel's output
  depends on its per-rank inputs, so it varies wherever they do)."""
  varying = frozenset().union(*(varying_axes(a) for a in args))

  def match(out):
    missing = tuple(sorted(varying - varying_axes(out)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out
  return jax.tree.map(match, outs)


def sum_to_primal(cotangent, primal):
  """`cotangent` summed over the axes it varies over and `primal` does not: the cotangent of a
  value that was shared (invariant) across those axes."""
  extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal)))
  return jax.lax.psum(cotangent, extra) if extra else cotangent
