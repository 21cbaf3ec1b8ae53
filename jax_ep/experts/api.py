"""`jax_ep.grouped_matmul`: rows grouped by expert times each expert's weights, `[rows, K] x
[G, K, N] -> [rows, N]`, as jax_ep's dispatch lays the rows out.

Two implementations behind the one function (`jax_ep/experts/choice.py` chooses, logging the
first use of each choice):
- `mosaic`: jax_ep's Pallas Mosaic GPU kernels (`jax_ep/experts/hopper.py` and
  `hopper_wgrad.py`: a work list of row tiles built on the device, a persistent grid, no step
  for row tiles past the groups), on Hopper GPUs (compute capability 9.0) for bf16 / f16
  operands of one dtype whose sizes its tiles divide (`jax_ep/experts/configs.py`); nothing is
  tuned at call time.
- `xla`: `jax.lax.ragged_dot` (and `ragged_dot_general` for the weight gradient), everywhere
  else. NOTES: on NVIDIA GPUs XLA lowers it to a dense masked expansion, `G` times the work,
  which runs out of memory at large expert counts: the reason for the Mosaic path.

Rows past `sum(group_sizes)` are unspecified in the result and never reach any result or
gradient: the worst-case capacity of a dispatch costs memory, not time. Gradients and `vmap`:
`jax_ep/experts/grouped.py`.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from jax_ep.experts import configs
from jax_ep.experts.checks import check_groups
from jax_ep.experts.grouped import grouped_matmul_op
from jax_ep.experts.layout import contiguous_offsets


def grouped_matmul(x, w, group_sizes, *, group_offsets=None, transpose_w: bool = False,
                   preferred_element_type=None, impl: str = "auto"):
  """Rows grouped by expert times each expert's weights.

  Args:
    x: `[rows, K]`, rows grouped contiguously: group g is the `group_sizes[g]` rows after those
      of groups `< g` (what `jax_ep.dispatch` returns in `recv.x`).
    w: `[G, K, N]`, or `[G, N, K]` with `transpose_w`, in `x`'s dtype.
    group_sizes: `[G]` int32, summing to at most `rows`.
    group_offsets: `[G]` int32, optional: group g is rows `[group_offsets[g], group_offsets[g]
      + group_sizes[g])` instead (ascending, disjoint, ending at most at `rows`; rows between
      groups are padding, unspecified like the rows past the groups). What
      `jax_ep.dispatch` returns in `recv.group_offsets` (with `expert_alignment`, each
      expert's rows start at a multiple of it).
    transpose_w: multiply by each `w[g]` transposed.
    preferred_element_type: the result's dtype (default `x.dtype`); the product accumulates in
      fp32 and is rounded once to it.
    impl: 'auto' (jax_ep's Mosaic GPU kernels where they run, see `grouped_matmul_impl`),
      'mosaic' or 'xla'.

  Returns:
    `[rows, N]`: row r of group g is `x[r] @ w[g]`; rows outside the groups are
    unspecified (on Hopper they are never computed: their cost is zero), and no result or
    gradient depends on what `x` holds there.
    Differentiable in `x` and `w`; `jax.vmap` over a leading axis of any argument runs one call.

  Raises:
    ValueError / TypeError: naming the argument, for shapes and dtypes that do not fit; and,
      where the values of `group_sizes` (and `group_offsets`) are known when the call is
      traced (an eager call, or constants under `jit`), for a negative size or offset, a group
      that ends past `rows`, or groups that overlap or are not in ascending order. Under `jit`
      traced values are not checked by default (breaking these rules then gives results
      other than the caller meant, with no error); a program traced inside
      `jax_ep.gmm.check_traced_groups()` checks them on the device by the same rules, run
      under `jax.experimental.checkify.checkify`.
  """
  for name, value, ndim in (("x", x, 2), ("w", w, 3), ("group_sizes", group_sizes, 1)):
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
      raise TypeError(f"jax_ep.grouped_matmul: {name} must be an array, got "
                      f"{type(value).__name__}")
    if value.ndim != ndim:
      raise ValueError(f"jax_ep.grouped_matmul: {name} must have {ndim} dimensions, got shape "
                       f"{value.shape}")
  k_w = w.shape[2] if transpose_w else w.shape[1]
  if x.shape[1] != k_w:
    layout = "[G, N, K]" if transpose_w else "[G, K, N]"
    raise ValueError(f"jax_ep.grouped_matmul: x is {x.shape} and w {w.shape}: w must be "
                     f"{layout} with K = {x.shape[1]}")
  if group_sizes.shape != (w.shape[0],):
    raise ValueError(f"jax_ep.grouped_matmul: group_sizes must have shape [G] = "
                     f"{(w.shape[0],)}, got {group_sizes.shape}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"jax_ep.grouped_matmul: group_sizes must be int32, got "
                    f"{group_sizes.dtype}")
  group_sizes = group_sizes.astype(jnp.int32)
  if group_offsets is None:
    check_groups(x.shape[0], group_sizes, None)
    group_offsets = contiguous_offsets(group_sizes)
  else:
    if not hasattr(group_offsets, "shape") or group_offsets.shape != group_sizes.shape:
      raise ValueError(f"jax_ep.grouped_matmul: group_offsets must have shape [G] = "
                       f"{group_sizes.shape}, got {getattr(group_offsets, 'shape', None)}")
    if not jnp.issubdtype(group_offsets.dtype, jnp.integer):
      raise TypeError(f"jax_ep.grouped_matmul: group_offsets must be int32, got "
                      f"{group_offsets.dtype}")
    group_offsets = group_offsets.astype(jnp.int32)
    check_groups(x.shape[0], group_sizes, group_offsets)
  if np.dtype(w.dtype) != np.dtype(x.dtype):
    raise TypeError(f"jax_ep.grouped_matmul: w must have x's dtype {x.dtype}, got {w.dtype}")
  out_dtype = np.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
  if impl == "auto":
    impl = configs.current().impl
  return grouped_matmul_op(x, w, group_sizes, group_offsets, bool(transpose_w), out_dtype, impl)

