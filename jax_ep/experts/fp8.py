"""FP8 expert GEMMs, DeepSeek-V3's recipe: e4m3 operands, activations scaled per row per 128
channels, weights per 128 x 128 block, partial sums promoted to fp32 every 128 elements of the
reduction, bf16 out.

- `Fp8Weights` / `quantize_weights`: an expert weight `[G, K, N]` quantised once (per step,
  not per micro-batch) into e4m3 values stored K-major (`[G, N, K]`: FP8 wgmma reads both
  operands K-major) and their block scales; on Hopper by one kernel over the master
  (`quantize_kernel.py`). Differentiable straight through: the values' cotangent comes back as
  the master weight's, in its dtype.
- `grouped_matmul_fp8`: `[rows, K] e4m3 x Fp8Weights -> [rows, N]`, rows grouped as
  `jax_ep.grouped_matmul`'s. Not differentiable itself: the recipe's gradients are the FP8
  expert MLP's (`jax_ep/experts/mlp_fp8.py`).

Implementations (`fp8_matmul_impl` chooses, logging the first use of each choice):
- `mosaic`: jax_ep's FP8 Mosaic GPU kernel on Hopper (`jax_ep/experts/hopper_fp8.py`).
- `xla`: the dequantised operands' product in float32 (`lax.ragged_dot`): off Hopper, and the
  kernel's oracle. On Hopper, for a shape the FP8 kernel does not take, the dequantised operands
  in bf16 through the bf16 grouped GEMM (logged): FP8 numerics, bf16 speed.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_ep.experts import builds, choice, configs
from jax_ep.experts.choice import say
from jax_ep.experts.layout import contiguous_offsets, spans

# The scales' granularity: activations per row per BLOCK channels, weights per BLOCK x BLOCK.
BLOCK = 128
E4M3 = np.dtype(jnp.float8_e4m3fn)
E4M3_MAX = 448.0


class Fp8Weights(NamedTuple):
  """An expert weight `[G, K, N]` in FP8: `values` `[G, N, K]` float8_e4m3fn (each expert's
  matrix transposed, K contiguous) and `scales` `[G, N / 128, K / 128]` float32, one per
  128 x 128 block: `w[g, k, n] ~= values[g, n, k] * scales[g, n // 128, k // 128]`."""
  values: jax.Array
  scales: jax.Array

  @property
  def shape(self) -> tuple[int, int, int]:
    """The master weight's shape `[G, K, N]`."""
    groups, n, k = self.values.shape
    return groups, k, n

  def transposed(self) -> Fp8Weights:
    """The weight `[G, N, K]` (each expert's matrix transposed) in the same bytes' layout
    swapped: what the input gradient multiplies by."""
    return Fp8Weights(jnp.swapaxes(self.values, 1, 2), jnp.swapaxes(self.scales, 1, 2))

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """`[G, K, N]` in `dtype`. Its cotangent passes straight through to `values` (laid out
    as they are), as `jax_ep.dequantize`'s to its rows: with `quantize_weights` before it, the
    master weight gets the cotangent of the dequantised one."""
    dequantize = functools.partial(_dequantize_weights, dtype=np.dtype(dtype))
    sharded = _sharding(self.values)
    if sharded is None:
      return dequantize(self.values, self.scales)
    mesh, (g, n, k) = sharded
    return jax.shard_map(dequantize, mesh=mesh, in_specs=(P(g, n, k), P(g, n, k)),
                         out_specs=P(g, k, n))(self.values, self.scales)


def _sharding(a):
  """`(mesh, spec of each dimension)` of an array sharded over Explicit mesh axes (a global
  weight laid out over the experts, say), else None. Such a weight is quantised and
  dequantised shard by shard (its blocks are each shard's own where every shard's K and N are
  multiples of 128): the blocks' reshapes cannot say how a sharded dimension splits."""
  sharding = getattr(jax.typeof(a), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if not spec or all(s is None for s in spec):
    return None
  return sharding.mesh, tuple(spec) + (None,) * (a.ndim - len(spec))


def _dequantize_blocks(values, scales, dtype):
  groups, n, k = values.shape
  blocks = values.astype(jnp.float32).reshape(groups, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
  w = blocks * scales.astype(jnp.float32)[:, :, None, :, None]
  return jnp.swapaxes(w.reshape(groups, n, k), 1, 2).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dequantize_weights(values, scales, dtype):
  return _dequantize_blocks(values, scales, dtype)


def _dequantize_weights_fwd(values, scales, dtype):
  return _dequantize_blocks(values, scales, dtype), None


def _dequantize_weights_bwd(dtype, residuals, d_w):
  del dtype, residuals
  return jnp.swapaxes(d_w, 1, 2), None


_dequantize_weights.defvjp(_dequantize_weights_fwd, _dequantize_weights_bwd)


def check_fp8_dims(fn: str, name: str, shape, dims: str = "K and N") -> None:
  """The FP8 recipe's sizes: multiples of 128 (one scale per 128 channels)."""
  if any(d % BLOCK for d in shape[-2:]):
    raise ValueError(f"jax_ep.{fn}: {name} is {tuple(shape)}: the FP8 recipe scales blocks of "
                     f"{BLOCK} channels, so {dims} must be multiples of {BLOCK}")


def _quantize_blocks(w):
  """`Fp8Weights` of `w` `[G, K, N]`: `scale = amax / 448` per 128 x 128 block (1 for an
  all-zero block; a NaN left out of the amax, kept in its element), values `w * (1 / scale)`
  rounded to nearest even (what XLA makes of `w / scale`: a division by a broadcast becomes a
  multiplication by its reciprocal)."""
  groups, k, n = w.shape
  # NOTES: blocked in w's own layout and transposed once, as e4m3: XLA then reads w twice (the
  # amax, then the rounding, whose fusion writes the transposed layout). Transposed before the
  # blocking (in bf16 or f32), XLA wrote the rounded values in an intermediate layout and
  # transposed them again: a third pass, 40 % more bytes.
  blocks = w.astype(jnp.float32).reshape(groups, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
  amax = jnp.max(jnp.where(jnp.isnan(blocks), 0.0, jnp.abs(blocks)), axis=(2, 4))
  scales = jnp.where(amax > 0, amax * (1.0 / E4M3_MAX), 1.0).astype(jnp.float32)
  values = (blocks * (1.0 / scales)[:, :, None, :, None]).astype(jnp.float8_e4m3fn)
  return Fp8Weights(jnp.swapaxes(values.reshape(groups, k, n), 1, 2),
                    jnp.swapaxes(scales, 1, 2))


def _quantize(w):
  """`_quantize_blocks`'s values and scales: on Hopper GPUs by jax_ep's one-pass kernel
  (`quantize_kernel.py`: the master read once), elsewhere (or with
  `jax_ep.experts.override(impl="xla")`) by XLA. The first use of each is logged."""
  shape = f"{list(w.shape)} {np.dtype(w.dtype).name}"
  if choice.on_hopper() and configs.current().impl != "xla":
    from jax_ep.experts.quantize_kernel import quantize_weight_blocks
    say("kernel", "one pass over the master", shape, op="quantize_weights")
    return Fp8Weights(*quantize_weight_blocks(w))
  say("xla", "two passes over the master", shape, op="quantize_weights")
  return _quantize_blocks(w)


@jax.custom_vjp
def _quantize_weights(w):
  return _quantize(w)


def _quantize_weights_fwd(w):
  # An empty array of w's dtype: all the backward needs of w.
  return _quantize(w), jnp.zeros((0,), w.dtype)


def _quantize_weights_bwd(residual, cotangents):
  # NOTES: the values' cotangent comes in a wider float dtype than e4m3 (the FP8 MLP's weight
  # gradients; JAX takes a custom_vjp cotangent of another float dtype for a float input, as
  # for the fp8 dispatch's rows), laid out as the values: transposed back to the master's.
  d_values = cotangents.values
  return (jnp.swapaxes(d_values, 1, 2).astype(residual.dtype),)


_quantize_weights.defvjp(_quantize_weights_fwd, _quantize_weights_bwd)


def quantize_weights(w) -> Fp8Weights:
  """An expert weight `[G, K, N]` (bf16 or f32 master) as `Fp8Weights`: e4m3 per 128 x 128
  block, `scale = amax / 448` (1 for an all-zero block), rounded to nearest even.

  Differentiable: the gradient passes straight through the rounding (DeepSeek-V3's recipe),
  so a weight quantised once and used by several micro-batches gets the sum of their
  gradients, in the master's dtype.

  Raises:
    ValueError: `w` not `[G, K, N]` floating with K and N multiples of 128.
  """
  if getattr(w, "ndim", None) != 3:
    raise ValueError(f"jax_ep.quantize_weights: w must be [G, K, N], got shape "
                     f"{getattr(w, 'shape', None)}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"jax_ep.quantize_weights: w must be floating, got {w.dtype}")
  check_fp8_dims("quantize_weights", "w", w.shape)
  sharded = _sharding(w)
  if sharded is None:
    return _quantize_weights(w)
  mesh, (g, k, n) = sharded
  local = jax.typeof(w).sharding.shard_shape(w.shape)
  if local[1] % BLOCK or local[2] % BLOCK:
    raise ValueError(f"jax_ep.quantize_weights: w {tuple(w.shape)} is sharded as {P(g, k, n)}: "
                     f"each shard's blocks are its own, so its K and N ({local[1]}, "
                     f"{local[2]}) must be multiples of {BLOCK}")
  out = P(g, n, k)
  return jax.shard_map(_quantize_weights, mesh=mesh, in_specs=P(g, k, n),
                       out_specs=Fp8Weights(out, out))(w)


def dequantize_rows(x, x_scales, dtype=jnp.float32):
  """e4m3 rows `[rows, K]` times their float32 scales `[rows, K / 128]`, in `dtype`."""
  rows, k = x.shape
  x32 = x.astype(jnp.float32).reshape(rows, k // BLOCK, BLOCK)
  return (x32 * x_scales.astype(jnp.float32)[..., None]).reshape(rows, k).astype(dtype)


def quantize_columns(x, x_scales, src, count):
  """XLA's `quantize_kernel.quantize_column_blocks`, the same rule bit for bit: `x` `[R, C]`
  (bf16 / f32, or e4m3 with its `[R, C / 128]` row scales, dequantised first) quantised per
  128 rows per channel into the group-aligned copy of `layout.aligned_blocks` (`src`, `count`
  `[NB]`), transposed: `(q [C, NB * 128] e4m3, scales [NB, C] f32)`, rows past a block's
  `count` zeros. The copy's rows are `fp8_quantize`d (each channel's 128 tokens a block)."""
  from jax_ep._native.fp8 import fp8_quantize
  rows, channels = x.shape
  rows_f32 = x.astype(jnp.float32) if x_scales is None else dequantize_rows(x, x_scales)
  i = jnp.arange(BLOCK, dtype=jnp.int32)
  inside = i[None, :] < count[:, None]  # [NB, 128]
  at = jnp.clip(src[:, None] + i[None, :], 0, max(rows - 1, 0))
  blocks = jnp.where(inside[:, :, None], rows_f32[at], 0.0)  # [NB, 128, C]
  q, scales = fp8_quantize(jnp.transpose(blocks, (2, 0, 1)).reshape(channels, -1))
  return q, scales.T


# ----------------------------------------------------------------------------------------------
# The choice.

def fp8_matmul_impl(rows: int, groups: int, k: int, n: int, *, impl: str = "auto"):
  """`(name, detail)` of the FP8 product for this shape: `("mosaic", tiles)` or `("xla", why
  the FP8 kernel does not run it)` (with `impl='auto'`, as `jax_ep.grouped_matmul_impl`)."""
  if impl not in ("auto", "mosaic", "xla"):
    raise ValueError(f"jax_ep.grouped_matmul_fp8: impl must be 'auto', 'mosaic' or 'xla', got "
                     f"{impl!r}")
  if impl == "auto":
    impl = configs.current().impl
  if impl == "xla":
    return "xla", "asked for"
  why = None
  tiles = None
  if not choice.on_hopper():
    why = "the FP8 Mosaic GPU kernel needs Hopper GPUs (compute capability 9.0)"
  else:
    tiles, why = _fp8_kernel_tiles(rows, groups, k, n)
  if tiles is not None:
    return "mosaic", tiles
  if impl == "mosaic":
    raise ValueError(f"jax_ep.grouped_matmul_fp8: impl='mosaic' cannot run [{rows}, {k}] x "
                     f"[{groups}, {k}, {n}]: {why}")
  return "xla", why


def _fp8_kernel_tiles(rows, groups, k, n):
  """`(tiles, None)` where the FP8 kernel runs this shape, else `(None, why)`."""
  tiles = configs.fp8_tile_config(groups, k, n)
  if tiles is None:
    return None, f"the FP8 kernel's 128-channel blocks do not divide K={k} and N={n}"
  why = fp8_compile_error(rows, groups, k, n, tiles)
  return (None, why) if why else (tiles, None)


@functools.cache
def fp8_compile_error(rows: int, groups: int, k: int, n: int, tiles) -> str | None:
  """Why the FP8 kernel does not compile for this shape (its shared memory, its registers), or
  None: compiled once per shape on abstract operands when the shape is first traced, so that
  a kernel that cannot build sends the shape to the fallback (logged) instead of failing the
  user's program when XLA compiles it. A known build (`builds.KNOWN_BUILDS`) is not
  compiled."""
  if builds.known_to_build(builds.fp8_gmm_build(tiles), rows):
    return None
  from jax_ep.experts.hopper_fp8 import fp8_grouped_matmul_kernel
  spec = jax.ShapeDtypeStruct
  operands = (spec((rows, k), E4M3), spec((rows, k // BLOCK), jnp.float32),
              spec((groups, n, k), E4M3), spec((groups, n // BLOCK, k // BLOCK), jnp.float32),
              spec((groups,), jnp.int32), spec((groups,), jnp.int32))
  try:
    jax.jit(functools.partial(fp8_grouped_matmul_kernel, tiles=tiles)).lower(
        *operands).compile()
  except Exception as e:  # noqa: BLE001 - any failure to build means: not this kernel
    return (f"the FP8 Mosaic GPU kernel did not compile for it ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})")
  return None


# ----------------------------------------------------------------------------------------------
# The product.

def fp8_product(x, x_scales, w: Fp8Weights, group_sizes, group_offsets, out_dtype, impl):
  """`[rows, N]` in `out_dtype` on checked operands; rows outside the groups unspecified."""
  rows, k = x.shape
  groups, _, n = w.shape
  name, detail = fp8_matmul_impl(rows, groups, k, n, impl=impl)
  say(name, detail, f"fp8 [{rows}, {k}] x [{groups}, {k}, {n}]")
  if rows == 0:
    return jnp.zeros((0, n), out_dtype)
  if name == "mosaic":  # pragma: no cover - Hopper only
    from jax_ep._native.varying import vary_like_operands
    from jax_ep.experts.hopper_fp8 import fp8_grouped_matmul_kernel
    y = fp8_grouped_matmul_kernel(x, x_scales, w.values, w.scales, group_sizes, group_offsets,
                                  tiles=detail, out_dtype=out_dtype)
    return vary_like_operands(y, (x, x_scales, w.values, w.scales, group_sizes, group_offsets))
  if choice.on_hopper():
    # The bf16 grouped GEMM (its Mosaic kernel) on the dequantised operands: the f32
    # ragged_dot is XLA's dense masked expansion on GPUs, G times the work.
    from jax_ep.experts.grouped import product_fn
    bf16 = np.dtype(jnp.bfloat16)
    return product_fn(False, np.dtype(out_dtype), "auto")(
        dequantize_rows(x, x_scales, bf16), _dequantize_blocks(w.values, w.scales, bf16),
        group_sizes, group_offsets)
  # NOTES: the dequantised operands materialised once: XLA otherwise fuses their e4m3
  # conversions (software on CPUs) into ragged_dot's per-group masked expansion, converting
  # every element once per group.
  x32, w32 = jax.lax.optimization_barrier(
      (dequantize_rows(x, x_scales), _dequantize_blocks(w.values, w.scales, np.float32)))
  return jax.lax.ragged_dot(x32, w32,
                            spans(rows, group_sizes, group_offsets),
                            preferred_element_type=jnp.float32).astype(out_dtype)


@configs.cache_per_overrides
def product_fn(out_dtype, impl: str):
  """`fp8_product` as a `(y,)`-valued function of `(x, x_scales, values, scales, sizes,
  offsets)`: `jax.vmap` over a leading axis runs one call (`mlp.rowwise_vmap`)."""
  from jax_ep.experts.mlp import rowwise_vmap

  def product(x, x_scales, values, scales, sizes, offsets):
    return (fp8_product(x, x_scales, Fp8Weights(values, scales), sizes, offsets, out_dtype,
                        impl),)
  return rowwise_vmap(product, 2)


def check_fp8_rows(fn: str, x, x_scales, hidden: int | None = None, name: str = "x") -> None:
  """e4m3 rows `[rows, K]` with float32 scales `[rows, K / 128]`, naming `fn`."""
  if getattr(x, "ndim", None) != 2:
    raise ValueError(f"jax_ep.{fn}: {name} must be [rows, K], got shape "
                     f"{getattr(x, 'shape', None)}")
  if np.dtype(x.dtype) != E4M3:
    raise TypeError(f"jax_ep.{fn}: {name} must be float8_e4m3fn (jax_ep.quantize's rows), got "
                    f"{x.dtype}")
  if hidden is not None and x.shape[1] != hidden:
    raise ValueError(f"jax_ep.{fn}: {name} is {tuple(x.shape)}: its rows must have the "
                     f"weights' {hidden} channels")
  check_fp8_dims(fn, name, x.shape, "its channels")
  want = (x.shape[0], x.shape[1] // BLOCK)
  if not hasattr(x_scales, "shape") or tuple(x_scales.shape) != want:
    raise ValueError(f"jax_ep.{fn}: {name}_scales must be [rows, K / 128] = {want} float32 "
                     f"(one per row per 128 channels), got shape "
                     f"{getattr(x_scales, 'shape', None)}")
  if np.dtype(x_scales.dtype) != np.float32:
    raise TypeError(f"jax_ep.{fn}: {name}_scales must be float32, got {x_scales.dtype} (unpack "
                    f"UE8M0 exponents with jax_ep.dequantize's rule first)")


def grouped_matmul_fp8(x, x_scales, w: Fp8Weights, group_sizes, *, group_offsets=None,
                       out_dtype=jnp.bfloat16, impl: str = "auto"):
  """Rows grouped by expert times each expert's FP8 weights: `[rows, K] x [G, K, N] ->
  [rows, N]`, DeepSeek-V3's FP8 GEMM.

  Args:
    x: `[rows, K]` float8_e4m3fn, grouped as `jax_ep.grouped_matmul`'s `x` (what
      `jax_ep.dispatch` returns with an fp8 `wire_format`, or `jax_ep.quantize`'s rows).
    x_scales: `[rows, K / 128]` float32: row `r`'s channels `[128 j, 128 (j + 1))` are
      `x[r] * x_scales[r, j]`.
    w: `Fp8Weights` of `[G, K, N]` weights (`jax_ep.quantize_weights`).
    group_sizes, group_offsets: as `jax_ep.grouped_matmul`'s.
    out_dtype: the result's dtype (default bf16).
    impl: 'auto', 'mosaic' (raises where the FP8 kernel cannot run) or 'xla'.

  Returns:
    `[rows, N]`: row r of group g is `sum_j (x[r, block j] @ values[g] block j) *
    x_scales[r, j] * w.scales[g, ., j]`, each 128-deep block's product promoted to fp32 and
    the sum rounded once to `out_dtype`. Rows outside the groups are unspecified, and no result
    depends on them. Not differentiable (the FP8 expert MLP, `jax_ep.expert_mlp(..., fp8=True)`,
    is). `jax.vmap` over a leading axis of any argument runs one call.
  """
  if not isinstance(w, Fp8Weights):
    raise TypeError(f"jax_ep.grouped_matmul_fp8: w must be jax_ep.Fp8Weights "
                    f"(jax_ep.quantize_weights of [G, K, N] weights), got {type(w).__name__}")
  groups, k, _ = w.shape
  check_fp8_rows("grouped_matmul_fp8", x, x_scales, hidden=k)
  from jax_ep.experts.checks import check_groups
  if getattr(group_sizes, "shape", None) != (groups,):
    raise ValueError(f"jax_ep.grouped_matmul_fp8: group_sizes must have shape [G] = "
                     f"{(groups,)}, got {getattr(group_sizes, 'shape', None)}")
  group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
  check_groups(x.shape[0], group_sizes, group_offsets, "jax_ep.grouped_matmul_fp8")
  group_offsets = (contiguous_offsets(group_sizes) if group_offsets is None
                   else jnp.asarray(group_offsets).astype(jnp.int32))
  (y,) = product_fn(np.dtype(out_dtype), impl)(x, x_scales, w.values, w.scales, group_sizes,
                                               group_offsets)
  return y

