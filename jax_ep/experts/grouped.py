"""The differentiable grouped GEMM: the forward product and the weight gradient on either
implementation (`choice.grouped_matmul_impl`), their `jax.vmap` rules and the `jax.custom_vjp`.

Gradients: `dx` is a grouped matmul of the cotangent with the transposed weights, `dw` a
per-group `x^T dy`. `jax.vmap` over a leading axis folds the batch into the rows and groups of
one call (`jax.custom_batching`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._native.varying import sum_to_primal, vary_like_operands
from jax_ep.experts import configs
from jax_ep.experts.choice import grouped_matmul_impl, say
from jax_ep.experts.hopper import grouped_matmul_kernel
from jax_ep.experts.hopper_wgrad import grouped_weight_grad_kernel
from jax_ep.experts.layout import (contiguous_offsets, flat_groups, fold_rows_by_group,
                                   inverse_permutation, rows_inside_groups, spans)


# ----------------------------------------------------------------------------------------------
# The two implementations of the forward product and of the weight gradient.

def _product(x, w, group_sizes, group_offsets, transpose_w, out_dtype, impl):
  """`[rows, N]` in out_dtype; rows outside the groups unspecified."""
  rows, k = x.shape
  groups = w.shape[0]
  n = w.shape[1] if transpose_w else w.shape[2]
  name, detail = grouped_matmul_impl(rows, groups, k, n, x.dtype, w.dtype, impl=impl,
                                     out_dtype=out_dtype)
  say(name, detail, f"[{rows}, {k}] x [{groups}, {k}, {n}]")
  if rows == 0:
    return jnp.zeros((0, n), out_dtype)
  if name == "mosaic":
    # NOTES: a Pallas kernel's result is typed as invariant inside shard_map; it depends on
    # the per-rank operands, so it varies wherever they do (and a custom_vjp cotangent must
    # carry its primal's type).
    y = grouped_matmul_kernel(x, w, group_sizes, group_offsets, transpose_w=transpose_w,
                              tiles=detail, out_dtype=out_dtype)
    return vary_like_operands(y, (x, w, group_sizes, group_offsets))
  w_kn = jnp.swapaxes(w, 1, 2) if transpose_w else w
  return jax.lax.ragged_dot(x, w_kn, spans(rows, group_sizes, group_offsets),
                            preferred_element_type=out_dtype)


def _weight_grad(x, dy, group_sizes, group_offsets, transpose_w, w_dtype, impl):
  """`[G, K, N]` (`[G, N, K]` with transpose_w): per group, `x^T dy` over its rows. Rows
  outside the groups never reach the result, whatever they hold."""
  rows, k = x.shape
  n = dy.shape[1]
  groups = group_sizes.shape[0]
  lhs, rhs = (dy, x) if transpose_w else (x, dy)
  if rows == 0:
    return jnp.zeros((groups, lhs.shape[1], rhs.shape[1]), w_dtype)
  name, detail = grouped_matmul_impl(rows, groups, k, n, x.dtype, dy.dtype, impl=impl)
  if name == "mosaic":
    config = configs.weight_grad_tiles(lhs.shape[1], rhs.shape[1], groups)
    # A shape the weight-gradient kernel's tiles do not divide takes ragged_dot_general (the
    # log says so once).
    if config is not None:
      dw = grouped_weight_grad_kernel(lhs, rhs, group_sizes, group_offsets, tiles=config,
                                      out_dtype=np.dtype(w_dtype),
                                      specialized=(configs.weight_grad_specialized()
                                                   or config.compute_wgs > 1),
                                      aligned=configs.weight_grad_aligned())
      return vary_like_operands(dw, (x, dy, group_sizes, group_offsets))
    say("xla", f"the weight-gradient kernel's tiles do not divide [{lhs.shape[1]}, "
         f"{rhs.shape[1]}]", f"weight gradient [{groups}, {lhs.shape[1]}, {rhs.shape[1]}]")
  # NOTES: ragged_dot_general may multiply the rows outside the groups by zero, and NaN * 0 is
  # NaN: select them away first (this path runs off Hopper, where the cost is accepted); the
  # zero rows of a gap then add nothing to the group before it.
  inside = rows_inside_groups(group_sizes, group_offsets, rows)[:, None]
  lhs = jnp.where(inside, lhs, jnp.zeros((), lhs.dtype))
  rhs = jnp.where(inside, rhs, jnp.zeros((), rhs.dtype))
  numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, spans(rows, group_sizes, group_offsets), numbers,
                                    preferred_element_type=jnp.float32).astype(w_dtype)


# ----------------------------------------------------------------------------------------------
# vmap: the batch folded into rows and groups, one call.

def _broadcast(value, batched, axis_size):
  return value if batched else jnp.broadcast_to(value, (axis_size, *value.shape))


@configs.cache_per_overrides
def product_fn(transpose_w: bool, out_dtype, impl: str):
  @jax.custom_batching.custom_vmap
  def product(x, w, group_sizes, group_offsets):
    return _product(x, w, group_sizes, group_offsets, transpose_w, out_dtype, impl)

  @product.def_vmap
  def product_vmap(axis_size, in_batched, x, w, group_sizes, group_offsets):
    x_b, w_b, gs_b, go_b = in_batched
    x = _broadcast(x, x_b, axis_size)
    group_sizes = _broadcast(group_sizes, gs_b, axis_size)
    group_offsets = _broadcast(group_offsets, go_b, axis_size)
    batch, rows, k = x.shape
    if rows == 0:
      n = w.shape[-2] if transpose_w else w.shape[-1]
      return jnp.zeros((batch, 0, n), out_dtype), True
    if w_b:
      # Weights per batch element: every element's groups in turn.
      sizes, offsets = flat_groups(group_sizes, group_offsets, rows)
      y = product(x.reshape(batch * rows, k), w.reshape(batch * w.shape[1], *w.shape[2:]),
                  sizes, offsets)
      return y.reshape(batch, rows, -1), True
    # Shared weights: rows reordered so that each group holds every element's rows of it.
    pos, totals = fold_rows_by_group(group_sizes, group_offsets, rows)
    x_sorted = x.reshape(batch * rows, k)[inverse_permutation(pos)]
    y = product(x_sorted, w, totals, contiguous_offsets(totals))
    return y[pos.reshape(-1)].reshape(batch, rows, -1), True

  return product


@configs.cache_per_overrides
def weight_grad_fn(transpose_w: bool, w_dtype, impl: str):
  @jax.custom_batching.custom_vmap
  def weight_grad(x, dy, group_sizes, group_offsets):
    return _weight_grad(x, dy, group_sizes, group_offsets, transpose_w, w_dtype, impl)

  @weight_grad.def_vmap
  def weight_grad_vmap(axis_size, in_batched, x, dy, group_sizes, group_offsets):
    x, dy, group_sizes, group_offsets = (
        _broadcast(v, b, axis_size)
        for v, b in zip((x, dy, group_sizes, group_offsets), in_batched))
    batch, rows, _ = x.shape
    groups = group_sizes.shape[1]
    if rows == 0:
      lhs, rhs = (dy, x) if transpose_w else (x, dy)
      return jnp.zeros((batch, groups, lhs.shape[-1], rhs.shape[-1]), w_dtype), True
    # Every element's groups in turn, over the elements' rows one after the other.
    sizes, offsets = flat_groups(group_sizes, group_offsets, rows)
    dw = weight_grad(x.reshape(batch * rows, -1), dy.reshape(batch * rows, -1), sizes, offsets)
    return dw.reshape(batch, groups, *dw.shape[1:]), True

  return weight_grad


# ----------------------------------------------------------------------------------------------
# The differentiable op.

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def grouped_matmul_op(x, w, group_sizes, group_offsets, transpose_w, out_dtype, impl):
  """`grouped_matmul` on checked operands: `group_offsets` given, `impl` resolved, `out_dtype`
  a numpy dtype."""
  return product_fn(transpose_w, out_dtype, impl)(x, w, group_sizes, group_offsets)


def _grouped_matmul_fwd(x, w, group_sizes, group_offsets, transpose_w, out_dtype, impl):
  y = product_fn(transpose_w, out_dtype, impl)(x, w, group_sizes, group_offsets)
  return y, (x, w, group_sizes, group_offsets)


def _grouped_matmul_bwd(transpose_w, out_dtype, impl, residuals, dy):
  x, w, group_sizes, group_offsets = residuals
  dy = dy.astype(x.dtype)
  dx = product_fn(not transpose_w, np.dtype(x.dtype), impl)(dy, w, group_sizes, group_offsets)
  dw = weight_grad_fn(transpose_w, np.dtype(w.dtype), impl)(x, dy, group_sizes, group_offsets)
  # Inside shard_map, weights shared over data axes get the sum of every replica's gradient.
  dx, dw = sum_to_primal(dx, x), sum_to_primal(dw, w)
  float0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  return dx, dw, float0(group_sizes), float0(group_offsets)


grouped_matmul_op.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
