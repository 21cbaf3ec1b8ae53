"""The expert MLP in FP8, DeepSeek-V3's recipe: `y = act(x @ w_gate) * (x @ w_up) @ w_down`
(gated; `act(x @ w_gate) @ w_down` plain) per expert with every product of the forward and of
the input gradient in FP8 (`jax_ep/experts/fp8.py`), the weight gradients in FP8 or bf16.

- forward: `x` arrives as e4m3 rows with per-128 scales (an fp8 dispatch's rows, or the
  activations quantised once); gate and up are FP8 products promoted to fp32; the activation
  runs in fp32 and `h` is quantised per row per 128 channels for the down projection, whose
  output is bf16. The gate and up projections are kept in bf16 for the backward (as the bf16
  MLP keeps them), with `h`'s e4m3 rows.
- backward: `dy` quantised per row over H, `dh = dy @ w_down^T` in FP8; `dgate`, `dup` in fp32
  from the saved projections, quantised per row over F, `dx = dgate @ w_gate^T + dup @ w_up^T`
  in FP8 (one product over both projections' reduction, summed in fp32), returned in bf16;
  the weight gradients `x^T [dgate | dup]` and `h^T dy` per expert in FP8, DeepSeek-V3's:
  reduced over the tokens, every operand quantised again per 128 tokens per channel (128 x 1
  blocks; `x` and `h` from their e4m3 rows) in a transposed copy that starts each group at a
  block, each block's product promoted to fp32, bf16 out; or with
  `jax_ep.experts.override(fp8_weight_grad=False)` in bf16 on the dequantised rows (jax_ep's
  bf16 weight-gradient kernel). Why FP8 is the default: `configs.fp8_weight_grads`.
- weights: `Fp8Weights` (`jax_ep.quantize_weights`, once per step); their gradients pass
  straight through to the bf16 / f32 masters.

On Hopper (`fp8_mlp_impl`) the gate and up projections are one kernel whose epilogue applies
the activation and quantises `h` (`hopper_fp8.fp8_gated_kernel`: no fp32 `[rows, F]` buffer),
every other product of the forward and the input gradient, `dx` of both projections included
(one product over both, `[dgate | dup] @ [w_gate | w_up]^T`), is
`hopper_fp8.fp8_grouped_matmul_kernel` (through `fp8.fp8_product`), and the FP8 weight
gradients are `hopper_fp8_wgrad.fp8_weight_grad_kernel` on
`quantize_kernel.quantize_column_blocks`' copies. Elsewhere the products are `fp8_product`'s
fallback and the activation runs between them; the FP8 weight gradients quantise the same way
in XLA and multiply the dequantised copies.

Rows outside the groups are unspecified in the result; every quantisation reads only rows of
the groups (row-local, or a block of one group's rows) and every product reads only the rows of
its groups, so no result or gradient depends on them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np

from jax_ep._native.fp8 import fp8_quantize, straight_through
from jax_ep._native.varying import sum_to_primal, vary_like_operands
from jax_ep.experts import builds, choice, configs, quantize_kernel
from jax_ep.experts.fp8 import (BLOCK, Fp8Weights, dequantize_rows, fp8_matmul_impl,
                                product_fn, quantize_columns)
from jax_ep.experts.grouped import weight_grad_fn
from jax_ep.experts.layout import (aligned_blocks, cdiv, contiguous_offsets, flat_groups,
                                   owner)
from jax_ep.experts.mlp import (GATED, SAVED_NAME, _broadcast, act, act_grad,
                                rowwise_vmap)

BF16 = np.dtype(jnp.bfloat16)


def _product(x, x_scales, w: Fp8Weights, sizes, offsets, out_dtype, impl="auto"):
  return product_fn(np.dtype(out_dtype), impl)(x, x_scales, w.values, w.scales, sizes,
                                                offsets)[0]


@configs.cache_per_overrides
def _gated_fn(activation: str):
  """The gated kernel as a `(h, h_scales, gate[, up])`-valued function for `rowwise_vmap`."""
  gated = activation in GATED

  def projections(x, x_scales, *args):
    *weights, sizes, offsets = args
    values_gate, scales_gate = weights[:2]
    values_up, scales_up = weights[2:] if gated else (None, None)
    from jax_ep.experts.hopper_fp8 import fp8_gated_kernel
    ffn, hidden = values_gate.shape[1:]
    h, h_scales, gate, up = fp8_gated_kernel(
        x, x_scales, values_gate, values_up, scales_gate, scales_up, sizes, offsets,
        activation=activation, tiles=configs.fp8_gated_tiles(hidden, ffn))
    outs = (h, h_scales, gate) + ((up,) if gated else ())
    return vary_like_operands(outs, (x, x_scales, *weights, sizes, offsets))

  return rowwise_vmap(projections, 2)


def _weight_args(*weights):
  return [a for w in weights if w is not None for a in (w.values, w.scales)]


def _projections(x, x_scales, w_gate, w_up, sizes, offsets, activation, fused):
  """`(h e4m3, h_scales, gate bf16, up bf16 or None)`."""
  if fused:
    outs = _gated_fn(activation)(x, x_scales, *_weight_args(w_gate, w_up), sizes, offsets)
    return (*outs, None) if len(outs) == 3 else tuple(outs)
  f32 = np.dtype(jnp.float32)
  gate = _product(x, x_scales, w_gate, sizes, offsets, f32)
  up = None if w_up is None else _product(x, x_scales, w_up, sizes, offsets, f32)
  h = act(gate, activation) * up if up is not None else act(gate, activation)
  h_q, h_scales = fp8_quantize(h)
  return h_q, h_scales, gate.astype(BF16), None if up is None else up.astype(BF16)


def _input_grad(d_projections, weights, sizes, offsets, quantised=None):
  """`dx` `[rows, H]` bf16 of the projections' cotangents: one FP8 product over both, `[dgate |
  dup] @ [w_gate | w_up]^T` (K = 2F), the fp32 sum rounded once. `quantised`: the cotangents'
  e4m3 values and scales side by side, where the activation-gradient kernel made them.

  NOTES: one product of twice the reduction, not two into one total: it runs the
  warp-specialized kernel (`fp8_grouped_matmul_kernel`; two compute warpgroups, one promoting
  while the other's wgmma runs). Each cotangent is quantised on its own and the e4m3 rows are
  concatenated: the same values and scales as the concatenation's (each scale's 128-channel
  block lies in one projection, F being a multiple of 128), and XLA computes each cotangent in
  the fusion that also writes its bf16 copy for the weight gradient (quantising the float32
  concatenation instead took 0.5 GB more at DeepSeek-V3's EP=8 rank)."""
  if quantised is None:
    each = [fp8_quantize(d) for d in d_projections]
    quantised = (q[0] if len(q) == 1 else jnp.concatenate(q, axis=1) for q in zip(*each))
  d_q, d_scales = quantised
  # Side by side along F ([G, 2F, H], the forward's layout), then transposed once: XLA writes
  # `[G, H, 2F]` in one pass over both (transposing each, then concatenating, took two).
  w = weights[0] if len(weights) == 1 else Fp8Weights(
      jnp.concatenate([w.values for w in weights], axis=1),
      jnp.concatenate([w.scales for w in weights], axis=1))
  return _product(d_q, d_scales, w.transposed(), sizes, offsets, BF16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def fp8_expert_mlp(x, x_scales, w_gate: Fp8Weights, w_up: Fp8Weights | None,
                   w_down: Fp8Weights, group_sizes, group_offsets, activation: str,
                   fused: bool = False):
  """`[rows, H]` e4m3 rows with their `[rows, H / 128]` float32 scales -> `[rows, H]` bf16 on
  `Fp8Weights` (`w_up` None for the plain activations). Differentiable in `x` (its cotangent
  in bf16) and the weights (straight through their quantisation to the masters). `fused`:
  the Hopper kernels (`fp8_mlp_impl`)."""
  h_q, h_scales, _, _ = _projections(x, x_scales, w_gate, w_up, group_sizes, group_offsets,
                                     activation, fused)
  return _product(h_q, h_scales, w_down, group_sizes, group_offsets, BF16)


def _fp8_fwd(x, x_scales, w_gate, w_up, w_down, group_sizes, group_offsets, activation,
             fused):
  h_q, h_scales, gate, up = _projections(x, x_scales, w_gate, w_up, group_sizes, group_offsets,
                                         activation, fused)
  y = _product(h_q, h_scales, w_down, group_sizes, group_offsets, BF16)
  saved = tuple(checkpoint_name(a, SAVED_NAME) for a in (gate, up) if a is not None)
  return y, (x, x_scales, w_gate, w_up, w_down, group_sizes, group_offsets, h_q, h_scales,
             saved)


def _fp8_bwd(activation, fused, residuals, dy):
  (x, x_scales, w_gate, w_up, w_down, group_sizes, group_offsets, h_q, h_scales,
   saved) = residuals
  f32 = np.dtype(jnp.float32)
  dy = dy.astype(BF16)
  kernels = fused and takes_row_kernels(dy.shape)
  dy_q, dy_scales = quantize_kernel.quantize_row_blocks(dy) if kernels else fp8_quantize(dy)
  dh = _product(dy_q, dy_scales, w_down.transposed(), group_sizes, group_offsets, f32)
  gated = activation in GATED
  weights = (w_gate, w_up) if gated else (w_gate,)
  quantised = None
  if kernels:
    # The cotangents' bf16 copies side by side, `[dgate | dup]`: the weight gradients' rows.
    *quantised, d_rows = quantize_kernel.activation_grad_blocks(
        dh, saved[0], saved[1] if gated else None, activation)
    d_projections = None
  else:
    if gated:
      gate, up = saved[0].astype(f32), saved[1].astype(f32)
      d_projections = (dh * up * act_grad(gate, activation), dh * act(gate, activation))
    else:
      gate = saved[0].astype(f32)
      d_projections = (dh * act_grad(gate, activation),)
    d_rows = jnp.concatenate([d.astype(BF16) for d in d_projections], axis=1)
  dx = _input_grad(d_projections, weights, group_sizes, group_offsets, quantised)
  if not configs.fp8_weight_grads():
    d_masters = _bf16_weight_grads(x, x_scales, d_rows, len(weights), h_q, h_scales, dy,
                                   group_sizes, group_offsets)
  else:
    d_masters = _weight_grads_fn(len(weights), kernels)(x, x_scales, d_rows, h_q, h_scales,
                                                        dy, group_sizes, group_offsets)
  # Each in its master's layout ([G, K, N]), transposed to its values' ([G, N, K]):
  # quantize_weights' backward transposes it back, and XLA cancels the two.
  d_weights = [Fp8Weights(sum_to_primal(jnp.swapaxes(d, 1, 2), w.values), None)
               for d, w in zip(d_masters, (*weights, w_down))]
  float0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  d_up = d_weights[1] if gated else None
  return (sum_to_primal(dx.astype(BF16), x), None, d_weights[0], d_up, d_weights[-1],
          float0(group_sizes), float0(group_offsets))


fp8_expert_mlp.defvjp(_fp8_fwd, _fp8_bwd)


# ----------------------------------------------------------------------------------------------
# The weight gradients.

def _bf16_weight_grads(x, x_scales, d_rows, parts, h_q, h_scales, dy, sizes, offsets):
  """The weight gradients in bf16 on the dequantised rows (`override(fp8_weight_grad=False)`),
  each in its master's layout `[G, K, N]`: `x^T` each projection's part of `[dgate | dup]`,
  `h^T dy`."""
  weight_grad = weight_grad_fn(False, BF16, "auto")
  x_rows = dequantize_rows(x, x_scales, BF16)
  h_rows = dequantize_rows(h_q, h_scales, BF16)
  ffn = d_rows.shape[1] // parts
  return tuple(weight_grad(x_rows, d_rows[:, i * ffn:(i + 1) * ffn], sizes, offsets)
               for i in range(parts)) + (weight_grad(h_rows, dy, sizes, offsets),)


def _fp8_weight_grads(x, x_scales, d_rows, h_q, h_scales, dy, sizes, offsets, parts: int,
                      kernels: bool):
  """The weight gradients in FP8, each in its master's layout `[G, K, N]`: `x^T [dgate |
  dup]` (one product, each projection's part its own result) and `h^T dy`, every operand
  quantised per 128 tokens per channel in a copy that starts each group at a block
  (`layout.aligned_blocks`), each block's product promoted to fp32, rounded to bf16. `x` and
  `h` come as the forward's e4m3 rows (dequantised, then quantised along the tokens), the
  cotangents in bf16. `kernels`: jax_ep's kernels (`quantize_kernel.quantize_column_blocks`,
  `hopper_fp8_wgrad.fp8_weight_grad_kernel`); else XLA, the same rounding, the product of the
  dequantised copies in float32 (bf16 on Hopper, through the bf16 grouped GEMM)."""
  rows, hidden = x.shape
  ffn = h_q.shape[1]
  groups = sizes.shape[0]
  if rows == 0:
    return tuple(jnp.zeros((groups, hidden, ffn), BF16) for _ in range(parts)) + (
        jnp.zeros((groups, ffn, hidden), BF16),)
  src, count, first, blocks = aligned_blocks(sizes, offsets, rows, BLOCK)
  quantize = quantize_kernel.quantize_column_blocks if kernels else quantize_columns
  x_t, d_t, dy_t, h_t = (quantize(a, s, src, count) for a, s in (
      (x, x_scales), (d_rows, None), (dy, None), (h_q, h_scales)))
  if kernels:
    from jax_ep.experts.hopper_fp8_wgrad import fp8_weight_grad_kernel
    up_tiles = configs.fp8_weight_grad_tiles(hidden, parts * ffn)
    d_proj = fp8_weight_grad_kernel(*x_t, *d_t, first, blocks, tiles=up_tiles, parts=parts)
    (d_down,) = fp8_weight_grad_kernel(*h_t, *dy_t, first, blocks,
                                       tiles=configs.fp8_weight_grad_tiles(ffn, hidden))
    return vary_like_operands((*d_proj, d_down),
                              (x, x_scales, d_rows, h_q, h_scales, dy, sizes, offsets))
  # The copies' groups follow each other from row 0, each a whole number of blocks.
  aligned = cdiv(sizes, BLOCK) * BLOCK
  aligned_offsets = contiguous_offsets(aligned)
  dtype, impl = (BF16, "auto") if choice.on_hopper() else (np.dtype(jnp.float32), "xla")
  # The copy's rows, dequantised: [NB * 128, C].
  rows_of = lambda q_t, scales: dequantize_rows(q_t, scales.T, dtype).T  # noqa: E731
  x_rows, h_rows = rows_of(*x_t), rows_of(*h_t)
  num_blocks = x_t[1].shape[0]
  if not choice.on_hopper() and num_blocks * hidden * parts * ffn <= _BLOCKWISE_ELEMENTS:
    weight_grad = functools.partial(_blockwise_weight_grad, block_end=jnp.cumsum(
        aligned // BLOCK), num_blocks=num_blocks)
  else:
    weight_grad = functools.partial(weight_grad_fn(False, BF16, impl), group_sizes=aligned,
                                    group_offsets=aligned_offsets)
  d_all = weight_grad(x_rows, rows_of(*d_t))
  d_down = weight_grad(h_rows, rows_of(*dy_t))
  return tuple(d_all[:, :, i * ffn:(i + 1) * ffn] for i in range(parts)) + (d_down,)


# The largest `[NB, K, N]` float32 of block products `_blockwise_weight_grad` holds (512 MiB).
_BLOCKWISE_ELEMENTS = 1 << 27


def _blockwise_weight_grad(x_rows, d_rows, *, block_end, num_blocks: int):
  """`[G, K, N]` bf16: each group's `x^T d` over a copy of whole 128-row blocks, one group's
  rows each (`block_end` `[G]`: each group's cumulative end in blocks; blocks past the groups
  are zeros): each block's product in float32, summed per group.

  NOTES: off Hopper the per-group product is XLA's `ragged_dot`, which XLA:CPU computes as a
  dense product masked per group, G times the work: here each block is multiplied once (and
  each block's product is promoted to float32 on its own, the recipe's order of sums)."""
  groups = block_end.shape[0]
  k, n = x_rows.shape[1], d_rows.shape[1]
  products = jnp.einsum("bik,bin->bkn", x_rows.reshape(num_blocks, BLOCK, k),
                        d_rows.reshape(num_blocks, BLOCK, n),
                        preferred_element_type=jnp.float32)
  group = owner(block_end, jnp.arange(num_blocks, dtype=jnp.int32))
  return jax.ops.segment_sum(products, group, num_segments=groups).astype(BF16)


@configs.cache_per_overrides
def _weight_grads_fn(parts: int, kernels: bool):
  """`_fp8_weight_grads` batched over a leading axis in one call: every element's groups in
  turn over the elements' rows one after the other (each element its own gradients)."""
  @jax.custom_batching.custom_vmap
  def grads(x, x_scales, d_rows, h_q, h_scales, dy, sizes, offsets):
    return _fp8_weight_grads(x, x_scales, d_rows, h_q, h_scales, dy, sizes, offsets, parts,
                             kernels)

  @grads.def_vmap
  def rule(axis_size, in_batched, *args):
    *rows_args, sizes, offsets = [_broadcast(a, b, axis_size) for a, b in zip(args, in_batched)]
    batch, rows = rows_args[0].shape[:2]
    groups = sizes.shape[1]
    flat = [a.reshape(batch * rows, a.shape[-1]) for a in rows_args]
    outs = grads(*flat, *flat_groups(sizes, offsets, rows))
    return (tuple(o.reshape(batch, groups, *o.shape[1:]) for o in outs),
            tuple(True for _ in outs))

  return grads


def takes_row_kernels(shape) -> bool:
  """Whether the FP8 MLP quantises its rows (`x`, `dy`) and computes the activation gradient
  in jax_ep's one-pass kernels (quantize_kernel.py: `quantize_row_blocks`,
  `activation_grad_blocks`) at the rows' `[rows, H]`, given the Hopper kernels (the caller's
  `fused`): where their row blocks divide the rows; else XLA's fusions (the rows read twice;
  the cotangents written in float32 and read again to quantise). The first use of each is
  logged."""
  from jax_ep.experts.choice import say
  rows = quantize_kernel.rows_per_program(shape[-2])
  if rows is not None:
    say("kernel", f"{rows}-row blocks", str(list(shape)), op="fp8_rows")
    return True
  say("xla", "rows off the kernels' blocks", str(list(shape)), op="fp8_rows")
  return False


# `fp8_quantize(x)` of the rows `[R, H]` by `quantize_kernel.quantize_row_blocks` (where
# `takes_row_kernels`), straight through as `primitives.quantize`; the kernel is looked up at
# each call, as the backward's is.
quantize_rows = straight_through(lambda x: quantize_kernel.quantize_row_blocks(x))


def fp8_saved_bytes(activation: str, rows: int, hidden: int, ffn: int) -> int:
  """What the FP8 MLP keeps for its backward: `x`'s e4m3 rows and scales, `h`'s, and the gate
  (and up) projections in bf16."""
  rows_bytes = lambda width: rows * (width + 4 * (width // 128))  # noqa: E731
  return rows_bytes(hidden) + rows_bytes(ffn) + (2 if activation in GATED else 1) * rows * ffn * 2


def fp8_weight_bytes(activation: str, groups: int, hidden: int, ffn: int) -> int:
  """The experts' `Fp8Weights`: 1 byte per parameter and a float32 scale per 128 x 128 block."""
  per_matrix = hidden * ffn + 4 * (hidden // 128) * (ffn // 128)
  return groups * per_matrix * (3 if activation in GATED else 2)


# ----------------------------------------------------------------------------------------------
# The choice.

def fp8_mlp_compile_error(rows: int, groups: int, hidden: int, ffn: int,
                          activation: str) -> str | None:
  """Why the FP8 MLP's Hopper kernels do not compile for this shape, or None (compiled once
  per shape and weight-gradient precision on abstract operands, forward and backward, when the
  shape is first traced; a known build, `builds.KNOWN_BUILDS`, is not compiled)."""
  return _fp8_mlp_compile_error(rows, groups, hidden, ffn, activation,
                                configs.fp8_weight_grads())


@configs.cache_per_overrides
def _fp8_mlp_compile_error(rows: int, groups: int, hidden: int, ffn: int, activation: str,
                           fp8_weight_grad: bool) -> str | None:
  if builds.known_to_build(
      builds.fp8_mlp_build(activation, hidden, ffn, groups, fp8_weight_grad), rows):
    return None
  gated = activation in GATED
  spec = jax.ShapeDtypeStruct
  e4m3 = jnp.float8_e4m3fn

  def weights(k, n):
    return Fp8Weights(spec((groups, n, k), e4m3), spec((groups, n // BLOCK, k // BLOCK),
                                                       jnp.float32))
  operands = (spec((rows, hidden), e4m3), spec((rows, hidden // BLOCK), jnp.float32),
              weights(hidden, ffn), weights(hidden, ffn) if gated else None,
              weights(ffn, hidden), spec((groups,), jnp.int32), spec((groups,), jnp.int32),
              spec((rows, hidden), jnp.bfloat16))

  # The cotangent is an operand: the gradient of a sum would make it a constant, which XLA
  # folds through the backward's quantisation (seconds of compile time at Mixtral's shape).
  # Every gradient: the weights' too, whose kernels XLA would drop with their unused results.
  def backward(x, xs, wg, wu, wd, sizes, offsets, dy):
    _, pullback = jax.vjp(
        lambda x, wg, wu, wd: fp8_expert_mlp(x, xs, wg, wu, wd, sizes, offsets, activation,
                                             True), x, wg, wu, wd)
    return pullback(dy)
  try:
    with configs.override(fp8_weight_grad=fp8_weight_grad):
      jax.jit(backward).lower(*operands).compile()
  except Exception as e:  # noqa: BLE001 - any failure to build means: not these kernels
    return (f"the FP8 kernels did not compile for it ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})")
  return None


def fp8_mlp_impl(rows: int, groups: int, hidden: int, ffn: int,
                 activation: str) -> tuple[bool, str]:
  """`(True, tiles)` where the FP8 MLP takes its Hopper kernels for this shape, else `(False,
  why not)` (each product then takes `fp8_product`'s choice)."""
  if configs.current().fused_mlp is False:
    return False, "the fused kernels are turned off (jax_ep.experts.override(fused_mlp=False))"
  if rows == 0:
    return False, "no rows"
  name, why = fp8_matmul_impl(rows, groups, hidden, ffn)
  if name != "mosaic":
    return False, f"the FP8 product takes its fallback here: {why}"
  parts = 2 if activation in GATED else 1
  tiles = (configs.fp8_gated_tiles(hidden, ffn), configs.fp8_tile_config(groups, parts * ffn,
                                                                         hidden))
  if None in tiles:
    return False, f"the FP8 kernels' 128-channel blocks do not divide H={hidden} and F={ffn}"
  why = fp8_mlp_compile_error(rows, groups, hidden, ffn, activation)
  if why:
    return False, why
  return True, f"gated {tiles[0]}, input gradient {tiles[1]}"
