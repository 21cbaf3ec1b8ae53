"""The expert MLP over expert-grouped rows, fused on Hopper: no pass over the whole buffer.

`y = act(x @ w_gate) * (x @ w_up) @ w_down` (gated; `act(x @ w_gate) @ w_down` plain) per
expert, on the rows inside the groups only:
- forward: gate and up as one kernel (`hopper_fused.fused_grouped_kernel`: one pass over `x`,
  two accumulators) whose epilogue applies the activation in fp32 and stores `h` in `x`'s
  dtype; the down projection stores `x`'s dtype (fp32 accumulation in the kernel). Under a
  gradient the first kernel also stores the gate and up projections in `x`'s dtype: the
  residuals (no float32 `[rows, F]` buffer).
- backward: `dh = dy @ w_down^T` in a kernel whose epilogue reads the saved gate and up tiles
  and stores `dgate = dh * up * act'(gate)`, `dup = dh * act(gate)` and `h` again (for
  `w_down`'s gradient); `dx = dgate @ w_gate^T + dup @ w_up^T` in one kernel (two passes into
  one accumulator); the weight gradients are the grouped GEMM's weight-gradient kernel, which
  selects away the rows outside the groups.
Every kernel runs the work list of row tiles that hold rows (`layout.row_tiles`) and stores
only rows inside the groups; no elementwise op, cast or copy touches the buffer's other rows.

`fused_mlp_impl` says whether a shape takes this path and why not (logged once per shape by
the caller); elsewhere `jax_ep.expert_mlp` runs three `grouped_matmul`s.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np

from jax_ep._native.varying import sum_to_primal, vary_like_operands
from jax_ep.experts import builds, configs
from jax_ep.experts import choice
from jax_ep.experts.choice import grouped_matmul_impl
from jax_ep.experts.grouped import product_fn, weight_grad_fn
from jax_ep.experts.hopper_fused import fused_grouped_kernel
from jax_ep.experts.layout import (contiguous_offsets, flat_groups, fold_rows_by_group,
                                   inverse_permutation)

GATED = ("swiglu", "geglu")
# The name of the saved gate and up projections, for `jax.checkpoint` policies
# (`jax.checkpoint_policies.save_only_these_names(SAVED_NAME)` keeps them).
SAVED_NAME = "jax_ep_expert_projections"
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ----------------------------------------------------------------------------------------------
# The activations, written with the operations the kernels' epilogues lower (exp, tanh,
# arithmetic): the same functions run in the kernels and in the reference.

def _silu_base(activation: str) -> bool:
  return activation in ("swiglu", "silu")


def act(g, activation: str):
  """`silu(g)` (swiglu, silu) or `gelu(g)` with the tanh approximation (geglu, gelu), as
  `jax.nn.silu` / `jax.nn.gelu`."""
  if _silu_base(activation):
    return g / (1.0 + jnp.exp(-g))
  return 0.5 * g * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))


def act_grad(g, activation: str):
  """The derivative of `act` at `g`."""
  if _silu_base(activation):
    s = 1.0 / (1.0 + jnp.exp(-g))
    return s * (1.0 + g * (1.0 - s))
  t = jnp.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g))
  return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (
      1.0 + 3.0 * 0.044715 * g * g)


# ----------------------------------------------------------------------------------------------
# The three fused kernels on one layout, each with a vmap rule.

def _broadcast(value, batched, axis_size):
  return value if batched else jnp.broadcast_to(value, (axis_size, *value.shape))


def rowwise_vmap(fn, num_rows: int):
  """`fn(*rows [rows, .], *weights [G, ., .], group_sizes, group_offsets) -> tuple of
  [rows, .]` batched over a leading axis in one call: shared weights take every element's rows
  regrouped by expert; per-element weights take every element's groups in turn."""
  op = jax.custom_batching.custom_vmap(fn)

  @op.def_vmap
  def rule(axis_size, in_batched, *args):
    rows_args = [_broadcast(a, b, axis_size) for a, b in zip(args[:num_rows], in_batched)]
    weights = args[num_rows:-2]
    weights_batched = in_batched[num_rows:-2]
    sizes = _broadcast(args[-2], in_batched[-2], axis_size)
    offsets = _broadcast(args[-1], in_batched[-1], axis_size)
    batch, rows = rows_args[0].shape[:2]
    flat = [a.reshape(batch * rows, a.shape[-1]) for a in rows_args]
    if any(weights_batched):
      weights = [_broadcast(w, b, axis_size) for w, b in zip(weights, weights_batched)]
      weights = [w.reshape(batch * w.shape[1], *w.shape[2:]) for w in weights]
      outs = op(*flat, *weights, *flat_groups(sizes, offsets, rows))
      return tuple(y.reshape(batch, rows, -1) for y in outs), tuple(True for _ in outs)
    pos, totals = fold_rows_by_group(sizes, offsets, rows)
    order = inverse_permutation(pos)
    outs = op(*(a[order] for a in flat), *weights, totals, contiguous_offsets(totals))
    back = pos.reshape(-1)
    return tuple(y[back].reshape(batch, rows, -1) for y in outs), tuple(True for _ in outs)

  return op


@configs.cache_per_overrides
def _projections_fn(activation: str, save: bool):
  """`(h,)`, or with `save` `(h, gate[, up])`, of `x` `[rows, H]` in `x`'s dtype."""
  gated = activation in GATED

  def epilogue(accs, _):
    gate = accs[0]
    h = act(gate, activation) * accs[1] if gated else act(gate, activation)
    return (h, *accs) if save else (h,)

  def projections(x, *weights_and_groups):
    *weights, sizes, offsets = weights_and_groups
    hidden, ffn = weights[0].shape[1:]
    targets = ((0, 0), (1, 1)) if gated else ((0, 0),)
    outs = fused_grouped_kernel(
        (x,), weights, sizes, offsets, passes=((0, targets),), transpose_w=False,
        tiles=configs.fused_tiles(hidden, ffn), epilogue=epilogue,
        out_dtypes=(x.dtype,) * ((1 + len(weights)) if save else 1),
        name="jax_ep_mlp_gate_up")
    return vary_like_operands(tuple(outs), (x, *weights, sizes, offsets))

  return rowwise_vmap(projections, 1)


@configs.cache_per_overrides
def _hidden_grad_fn(activation: str):
  """`(dgate[, dup], h)` from `dy` `[rows, H]`, `w_down` and the saved projections."""
  gated = activation in GATED

  def epilogue(accs, loaded):
    dh, gate = accs[0], loaded[0].astype(jnp.float32)
    a = act(gate, activation)
    da = act_grad(gate, activation)
    if gated:
      up = loaded[1].astype(jnp.float32)
      return dh * up * da, dh * a, a * up
    return dh * da, a

  def hidden_grad(dy, *args):
    saved = args[:2] if gated else args[:1]
    w_down, sizes, offsets = args[len(saved):]
    ffn, hidden = w_down.shape[1:]
    tiles = configs.fused_hidden_grad_tiles(hidden, ffn)
    outs = fused_grouped_kernel(
        (dy,), (w_down,), sizes, offsets, passes=((0, ((0, 0),)),), transpose_w=True,
        tiles=tiles, epilogue=epilogue, out_dtypes=(dy.dtype,) * (len(saved) + 1), loads=saved,
        epilogue_columns=configs.hidden_grad_epilogue_columns(tiles),
        name="jax_ep_mlp_hidden_grad")
    return vary_like_operands(tuple(outs), (dy, *saved, w_down, sizes, offsets))

  return rowwise_vmap(hidden_grad, 3 if gated else 2)


@configs.cache_per_overrides
def _input_grad_fn(gated: bool):
  """`(dx,)`: `dgate @ w_gate^T (+ dup @ w_up^T)` in one accumulator."""
  def input_grad(*args):
    grads = args[:2] if gated else args[:1]
    weights = args[len(grads):-2]
    sizes, offsets = args[-2:]
    hidden, ffn = weights[0].shape[1:]
    passes = tuple((i, ((i, 0),)) for i in range(len(grads)))
    outs = fused_grouped_kernel(
        grads, weights, sizes, offsets, passes=passes, transpose_w=True,
        tiles=configs.fused_input_grad_tiles(ffn, hidden), epilogue=lambda accs, _: accs,
        out_dtypes=(grads[0].dtype,), name="jax_ep_mlp_input_grad")
    return vary_like_operands(tuple(outs), (*grads, *weights, sizes, offsets))

  return rowwise_vmap(input_grad, 2 if gated else 1)


# ----------------------------------------------------------------------------------------------
# The differentiable MLP.

def _weights(w_gate, w_up):
  return (w_gate,) if w_up is None else (w_gate, w_up)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def fused_expert_mlp(x, w_gate, w_up, w_down, group_sizes, group_offsets, activation):
  """`[rows, H] -> [rows, H]` in `x`'s dtype on the fused Hopper kernels; `w_up` None for the
  plain activations. Rows outside the groups unspecified."""
  (h,) = _projections_fn(activation, False)(x, *_weights(w_gate, w_up), group_sizes,
                                             group_offsets)
  return product_fn(False, np.dtype(x.dtype), "auto")(h, w_down, group_sizes, group_offsets)


def _fused_fwd(x, w_gate, w_up, w_down, group_sizes, group_offsets, activation):
  h, *saved = _projections_fn(activation, True)(x, *_weights(w_gate, w_up), group_sizes,
                                                 group_offsets)
  y = product_fn(False, np.dtype(x.dtype), "auto")(h, w_down, group_sizes, group_offsets)
  saved = tuple(checkpoint_name(a, SAVED_NAME) for a in saved)
  return y, (x, w_gate, w_up, w_down, group_sizes, group_offsets, saved)


def _fused_bwd(activation, residuals, dy):
  x, w_gate, w_up, w_down, group_sizes, group_offsets, saved = residuals
  dtype = np.dtype(x.dtype)
  dy = dy.astype(dtype)
  *d_projections, h = _hidden_grad_fn(activation)(dy, *saved, w_down, group_sizes,
                                                  group_offsets)
  weights = _weights(w_gate, w_up)
  (dx,) = _input_grad_fn(w_up is not None)(*d_projections, *weights, group_sizes,
                                            group_offsets)
  weight_grad = weight_grad_fn(False, dtype, "auto")
  d_weights = [sum_to_primal(weight_grad(x, d, group_sizes, group_offsets), w)
               for d, w in zip(d_projections, weights)]
  d_down = sum_to_primal(weight_grad(h, dy, group_sizes, group_offsets), w_down)
  float0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  d_up = d_weights[1] if w_up is not None else None
  return (sum_to_primal(dx, x), d_weights[0], d_up, d_down, float0(group_sizes),
          float0(group_offsets))


fused_expert_mlp.defvjp(_fused_fwd, _fused_bwd)


# ----------------------------------------------------------------------------------------------
# The choice.

@configs.cache_per_overrides
def fused_compile_error(rows: int, groups: int, hidden: int, ffn: int, dtype,
                        activation: str) -> str | None:
  """Why the fused kernels do not compile for this shape, or None (compiled once per shape on
  abstract operands, forward and backward, when the shape is first traced; a known build,
  `builds.KNOWN_BUILDS`, is not compiled)."""
  if builds.known_to_build(builds.fused_mlp_build(dtype, activation, hidden, ffn, groups),
                            rows):
    return None
  gated = activation in GATED
  spec = jax.ShapeDtypeStruct
  operands = (spec((rows, hidden), dtype), spec((groups, hidden, ffn), dtype),
              spec((groups, hidden, ffn), dtype) if gated else None,
              spec((groups, ffn, hidden), dtype), spec((groups,), jnp.int32),
              spec((groups,), jnp.int32))

  # The cotangent is an operand, not the constant a sum's gradient would be (XLA would fold
  # it into the backward).
  def backward(x, wg, wu, wd, s, o, dy):
    _, pullback = jax.vjp(lambda *a: fused_expert_mlp(*a, s, o, activation), x, wg, wu, wd)
    return pullback(dy)
  try:
    jax.jit(backward).lower(*operands, spec((rows, hidden), dtype)).compile()
  except Exception as e:  # noqa: BLE001 - any failure to build means: not these kernels
    return (f"the fused kernels did not compile for it ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})")
  return None


def fused_mlp_impl(rows: int, groups: int, hidden: int, ffn: int, dtype,
                   activation: str, *, probe: bool = True) -> tuple[bool, str]:
  """`(True, tiles)` where `expert_mlp` takes the fused kernels for this shape, else
  `(False, why not)`. `probe=False` skips compiling the kernels (a size estimate's answer)."""
  forced = configs.current().fused_mlp
  if forced is False:
    return False, "the fused kernels are turned off (jax_ep.experts.override(fused_mlp=False))"
  if rows == 0:
    return False, "no rows"
  impl = configs.current().impl
  if probe:
    name, why = grouped_matmul_impl(rows, groups, hidden, ffn, dtype, impl=impl)
  else:  # the grouped GEMM's checks that compile nothing
    name, why = "mosaic", None
    if impl == "xla":
      name, why = "xla", "asked for"
    elif not choice.on_hopper():
      name, why = "xla", "the Mosaic GPU kernel needs Hopper GPUs (compute capability 9.0)"
    elif np.dtype(dtype) not in choice.MOSAIC_DTYPES:
      name, why = "xla", f"the Mosaic GPU kernel takes bf16 or f16 operands, got {dtype}"
  if name != "mosaic":
    return False, f"the grouped GEMM takes lax.ragged_dot here: {why}"
  tiles = configs.fused_tiles(hidden, ffn)
  if (tiles is None or configs.fused_hidden_grad_tiles(hidden, ffn) is None
      or configs.fused_input_grad_tiles(ffn, hidden) is None):
    return False, (f"the fused kernels' tiles do not divide H={hidden} and F={ffn} (multiples "
                   f"of 64)")
  why = probe and fused_compile_error(rows, groups, hidden, ffn, np.dtype(dtype), activation)
  if why:
    return False, why
  return True, str(tiles)


def fused_saved_bytes(activation: str, rows: int, ffn: int, dtype) -> int:
  """What the fused MLP keeps for its backward besides `x` and the groups: the gate (and up)
  projections `[rows, F]` in `dtype`."""
  return (2 if activation in GATED else 1) * rows * ffn * np.dtype(dtype).itemsize
