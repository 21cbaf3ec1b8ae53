"""Grouped matrix multiplication for the expert MLP: rows grouped by expert times each expert's
weights, `[rows, K] x [G, K, N] -> [rows, N]`, as jax_ep's dispatch lays the rows out.

Two implementations behind one function, `grouped_matmul`:
- `mosaic`: jax_ep's Pallas Mosaic GPU kernels (`jax_ep/kernels/gmm_kernels.py`: a work list of row
  tiles built on the device, a persistent grid, no step for row tiles past the groups), on
  Hopper GPUs (compute capability 9.0) for bf16 / f16 operands of one dtype whose sizes its
  tiles divide. Tiles come from a table of shapes (`TILE_TABLE`) or, for the rest, a rule
  (`tile_config`); nothing is tuned at call time.
- `xla`: `jax.lax.ragged_dot` (and `ragged_dot_general` for the weight gradient), everywhere
  else. NOTES: on NVIDIA GPUs XLA lowers it to a dense masked expansion, `G` times the work,
  which runs out of memory at large expert counts: the reason for the Mosaic path.

Rows past `sum(group_sizes)` are unspecified in the result and never reach any result or
gradient: the worst-case capacity of a dispatch costs memory, not time.

`grouped_matmul_impl(...)` says which one a shape gets and why; the first call of each choice
is logged (`jax_ep` logger). Gradients are a `jax.custom_vjp` (`dx` is a grouped matmul of the
cotangent with the transposed weights, `dw` a per-group `x^T dy`), and `jax.vmap` over a
leading axis folds the batch into the rows and groups of one call (`jax.custom_batching`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jax_ep._native.varying import sum_to_primal, vary_like_operands
from jax_ep.kernels.gmm_kernels import KernelTiles, grouped_matmul_kernel, grouped_weight_grad_kernel

_logger = logging.getLogger("jax_ep")


# The kernels' tiles (`jax_ep.kernels.gmm_kernels.KernelTiles`).
TileConfig = KernelTiles


# Tiles for shapes `(groups, K, N)` measured on an H200 with `benchmarks/bench_layer.py
# --tune`; shapes not listed take `tile_config`'s rule.
TILE_TABLE: dict[tuple[int, int, int], TileConfig] = {
    (256, 7168, 2048): TileConfig(128, 128, 64, 3, 1, 2),  # DeepSeek-V3
    (128, 2048, 768): TileConfig(128, 64, 64, 6, 1, 2),  # Qwen3-30B-A3B
    (32, 4096, 1536): TileConfig(128, 64, 64, 6, 4, 2),
    (8, 4096, 14336): TileConfig(128, 128, 64, 3, 1, 2),  # Mixtral 8x7B
}

# The weight gradient's kernel: warp-specialized (a memory warpgroup loads the next output
# tile's row blocks while the compute warpgroup stores the last), or one warpgroup. NOTES: the
# one-warpgroup kernel with 4 stages was as fast or faster at the four model shapes on an H200
# (e.g. 561 vs 483 TF/s at Mixtral, 164 vs 158 at DeepSeek-V3): there the output tile's store
# and the operands' re-reads from L2, not the pipeline's fill, bound the time.
WEIGHT_GRAD_SPECIALIZED = False

# The row tile of jax_ep's grouped GEMM on Hopper: capacities derived from `capacity_factor`
# round up to it, so that the buffer is a whole number of tiles.
ROW_TILE = 128

_MOSAIC_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_SAID: set = set()
# What impl='auto' means inside `impl_override` (benchmarks compare the implementations in one
# layer without threading an argument through it).
_AUTO = contextvars.ContextVar("jax_ep_grouped_matmul_impl", default="auto")


@contextlib.contextmanager
def impl_override(impl: str):
  """Within the block, `grouped_matmul(..., impl='auto')` traces as `impl` ('mosaic', 'xla' or
  'auto'): e.g. a whole layer timed on either implementation."""
  if impl not in ("auto", "mosaic", "xla"):
    raise ValueError(f"jax_ep.gmm.impl_override: impl must be 'auto', 'mosaic' or 'xla', "
                     f"got {impl!r}")
  token = _AUTO.set(impl)
  try:
    yield
  finally:
    _AUTO.reset(token)


def tile_config(rows: int, groups: int, k: int, n: int) -> TileConfig | None:
  """The kernels' tiles for `[rows, k] x [groups, k, n]`, or None where they cannot divide it
  (`k` must be a multiple of `block_k`, `n` of `block_n`)."""
  del rows  # the work list makes the row count matter only through the groups' boundaries
  if (groups, k, n) in TILE_TABLE:
    return TILE_TABLE[(groups, k, n)]
  block_k = 64
  if k % block_k:
    return None
  # The warp-specialized kernel (two compute warpgroups of block_n columns each) where N
  # holds its CTA tile: the fastest at every measured shape; the one-warpgroup kernel else.
  if n % 256 == 0:
    return TileConfig(block_m=ROW_TILE, block_n=128, block_k=block_k, stages=3, band=1,
                      compute_wgs=2)
  if n % 128 == 0:
    return TileConfig(block_m=ROW_TILE, block_n=64, block_k=block_k, stages=6, band=4,
                      compute_wgs=2)
  if n % 64 == 0:
    return TileConfig(block_m=ROW_TILE, block_n=64, block_k=block_k, stages=4, band=4)
  return None


def weight_grad_tiles(k: int, n: int) -> TileConfig | None:
  """The weight-gradient kernel's tiles for `[G, k, n]`: its output tiled `block_m x block_n`,
  the rows reduced `block_k` at a time; None where they do not divide `k` and `n`."""
  if k % ROW_TILE:
    return None
  block_n = next((b for b in (128, 64) if n % b == 0), None)
  if block_n is None:
    return None
  return TileConfig(block_m=ROW_TILE, block_n=block_n, block_k=64, stages=4, band=4)


def _on_hopper() -> bool:
  try:
    devices = jax.devices()
  except RuntimeError:
    return False
  return bool(devices) and all(
      d.platform == "gpu" and getattr(d, "compute_capability", "") == "9.0" for d in devices)


def grouped_matmul_impl(rows: int, groups: int, k: int, n: int, dtype, w_dtype=None,
                        *, transpose_w: bool = False, impl: str = "auto", out_dtype=None):
  """`(name, detail)` of the implementation `grouped_matmul` uses for this shape: `("mosaic",
  TileConfig)` or `("xla", why the Mosaic kernel does not run it)`.

  Args:
    rows, groups, k, n: `x` is `[rows, k]`, the weights `[groups, k, n]`.
    dtype, w_dtype: the operands' dtypes (`w_dtype` defaults to `dtype`).
    transpose_w: the weights are stored `[groups, n, k]`.
    impl: 'auto', 'mosaic' (raises where it cannot run) or 'xla'.
    out_dtype: the result's dtype (default `dtype`).
  """
  if impl not in ("auto", "mosaic", "xla"):
    raise ValueError(f"jax_ep.grouped_matmul: impl must be 'auto', 'mosaic' or 'xla', "
                     f"got {impl!r}")
  if impl == "xla":
    return "xla", "asked for"
  dtype = np.dtype(dtype)
  w_dtype = dtype if w_dtype is None else np.dtype(w_dtype)
  why = None
  config = None
  if not _on_hopper():
    why = "the Mosaic GPU kernel needs Hopper GPUs (compute capability 9.0)"
  elif dtype not in _MOSAIC_DTYPES or w_dtype != dtype:
    why = (f"the Mosaic GPU kernel takes bf16 or f16 operands of one dtype, got {dtype} and "
           f"{w_dtype}")
  else:
    config = tile_config(rows, groups, k, n)
    if config is None:
      why = f"its tiles do not divide K={k} (multiples of 64) or N={n} (multiples of 64)"
    else:
      out_dtype = dtype if out_dtype is None else np.dtype(out_dtype)
      first_why = None
      for candidate in _fallback_tiles(config, n):
        why = _mosaic_compile_error(rows, groups, k, n, dtype, transpose_w, candidate,
                                    out_dtype)
        if why is None:
          config = candidate
          break
        first_why = first_why or why
      else:
        config, why = None, first_why
  if config is not None:
    return "mosaic", config
  if impl == "mosaic":
    raise ValueError(f"jax_ep.grouped_matmul: impl='mosaic' cannot run [{rows}, {k}] x "
                     f"[{groups}, {k}, {n}]: {why}")
  return "xla", why


def _fallback_tiles(config: TileConfig, n: int):
  """`config`, then tiles that need less shared memory, in the order tried where it does not
  build (e.g. a float32 result's staging buffers beside the warp-specialized kernel's
  stages): fewer stages of the same kernel, then the one-warpgroup kernel."""
  yield config
  if config.compute_wgs > 1:
    for stages in range(config.stages - 1, 1, -1):
      yield dataclasses.replace(config, stages=stages)
  block_n = 128 if n % 128 == 0 else 64
  for stages in (4, 3, 2):
    plain = TileConfig(block_m=config.block_m, block_n=block_n, block_k=config.block_k,
                       stages=stages, band=4)
    if plain != config:
      yield plain


@functools.cache
def _mosaic_compile_error(rows, groups, k, n, dtype, transpose_w, config,
                          out_dtype) -> str | None:
  """Why the Mosaic kernel does not compile for this shape (e.g. its tiles exceed shared
  memory), or None. NOTES: compiled once per shape, on abstract operands, when the shape is
  first traced: a kernel that cannot build sends the shape to lax.ragged_dot (logged) instead
  of failing the user's whole program when XLA compiles it."""
  w_shape = (groups, n, k) if transpose_w else (groups, k, n)
  operands = (jax.ShapeDtypeStruct((rows, k), dtype), jax.ShapeDtypeStruct(w_shape, dtype),
              jax.ShapeDtypeStruct((groups,), jnp.int32),
              jax.ShapeDtypeStruct((groups,), jnp.int32))
  try:
    jax.jit(lambda x, w, s, o: _mosaic_ragged_dot(x, w, s, o, transpose_w, config,
                                                  out_dtype)).lower(*operands).compile()
  except Exception as e:  # noqa: BLE001 - any failure to build means: not this kernel
    return f"the Mosaic GPU kernel did not compile for it ({type(e).__name__}: " \
           f"{str(e).splitlines()[0][:200] if str(e) else ''})"
  return None


def _say(name, detail, shape):
  key = (name, str(detail), shape)
  if key not in _SAID:
    _SAID.add(key)
    _logger.info("jax_ep.grouped_matmul %s: %s (%s)", shape, name, detail)


# ----------------------------------------------------------------------------------------------
# The two implementations of the forward product and of the weight gradient.

def _mosaic_ragged_dot(x, w, group_sizes, group_offsets, transpose_w, config, out_dtype=None):
  return grouped_matmul_kernel(x, w, group_sizes, group_offsets, transpose_w=transpose_w,
                               tiles=config, out_dtype=out_dtype)


def _mosaic_weight_grad(x, dy, group_sizes, group_offsets, config, out_dtype=None,
                        specialized=None):
  if specialized is None:
    specialized = WEIGHT_GRAD_SPECIALIZED
  return grouped_weight_grad_kernel(x, dy, group_sizes, group_offsets, tiles=config,
                                    out_dtype=out_dtype, specialized=specialized)


def _rows_inside(rows, group_sizes, group_offsets):
  """`[rows, 1]` bool: the rows inside some group (the groups are ascending and disjoint)."""
  starts, ends = group_offsets, group_offsets + group_sizes
  edges = jnp.zeros((rows + 1,), jnp.int32).at[starts].add(1).at[ends].add(-1)
  return (jnp.cumsum(edges)[:rows] > 0)[:, None]


def _spans(rows, group_sizes, group_offsets):
  """`[G]` sizes that give each group the rows from its start to the next group's start (the
  first also the rows before it): `lax.ragged_dot`'s contiguous groups over a layout with gaps.
  A gap's rows are multiplied by the group before it: unspecified rows, like the gap."""
  starts = group_offsets
  spans = jnp.concatenate([starts[1:] - starts[:-1], group_sizes[-1:]])
  return spans.at[0].add(starts[0])


def _product(x, w, group_sizes, group_offsets, transpose_w, out_dtype, impl):
  """`[rows, N]` in out_dtype; rows outside the groups unspecified."""
  rows, k = x.shape
  groups = w.shape[0]
  n = w.shape[1] if transpose_w else w.shape[2]
  name, detail = grouped_matmul_impl(rows, groups, k, n, x.dtype, w.dtype, impl=impl,
                                     out_dtype=out_dtype)
  _say(name, detail, f"[{rows}, {k}] x [{groups}, {k}, {n}]")
  if rows == 0:
    return jnp.zeros((0, n), out_dtype)
  if name == "mosaic":
    # NOTES: a Pallas kernel's result is typed as invariant inside shard_map; it depends on
    # the per-rank operands, so it varies wherever they do (and a custom_vjp cotangent must
    # carry its primal's type).
    y = _mosaic_ragged_dot(x, w, group_sizes, group_offsets, transpose_w, detail, out_dtype)
    return vary_like_operands(y, (x, w, group_sizes, group_offsets))
  w_kn = jnp.swapaxes(w, 1, 2) if transpose_w else w
  return jax.lax.ragged_dot(x, w_kn, _spans(rows, group_sizes, group_offsets),
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
    config = weight_grad_tiles(lhs.shape[1], rhs.shape[1])
    # A shape the weight-gradient kernel's tiles do not divide takes ragged_dot_general (the
    # log says so once).
    if config is not None:
      dw = _mosaic_weight_grad(lhs, rhs, group_sizes, group_offsets, config, np.dtype(w_dtype))
      return vary_like_operands(dw, (x, dy, group_sizes, group_offsets))
    _say("xla", f"the weight-gradient kernel's tiles do not divide [{lhs.shape[1]}, "
         f"{rhs.shape[1]}]", f"weight gradient [{groups}, {lhs.shape[1]}, {rhs.shape[1]}]")
  # NOTES: ragged_dot_general may multiply the rows outside the groups by zero, and NaN * 0 is
  # NaN: select them away first (this path runs off Hopper, where the cost is accepted); the
  # zero rows of a gap then add nothing to the group before it.
  inside = _rows_inside(rows, group_sizes, group_offsets)
  lhs = jnp.where(inside, lhs, jnp.zeros((), lhs.dtype))
  rhs = jnp.where(inside, rhs, jnp.zeros((), rhs.dtype))
  numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, _spans(rows, group_sizes, group_offsets), numbers,
                                    preferred_element_type=jnp.float32).astype(w_dtype)


# ----------------------------------------------------------------------------------------------
# vmap: the batch folded into rows and groups, one call.

def _fold_rows_by_group(group_sizes, group_offsets, rows):
  """For `[B, G]` groups over `[B, rows]` rows: `(pos [B, rows], sizes [G])` where row r of
  batch b goes to `pos[b, r]` of a `[B * rows]` layout whose group g holds every batch's rows of
  g (batches in order), followed by every row outside the groups."""
  starts = group_offsets
  ends = starts + group_sizes  # [B, G]
  r = jnp.arange(rows, dtype=jnp.int32)
  groups = group_sizes.shape[1]
  # The last group starting at or before the row (groups are ascending and disjoint; an empty
  # group sharing a start with the next loses the tie). Comparisons, not jnp.searchsorted (a
  # while loop: a launch and host round trip per step).
  group = jnp.sum(starts[:, None, :] <= r[None, :, None], axis=2, dtype=jnp.int32) - 1
  g = jnp.clip(group, 0, groups - 1)
  inside = (group >= 0) & (r[None, :] < jnp.take_along_axis(ends, g, axis=1))
  totals = jnp.sum(group_sizes, axis=0)  # [G]
  group_start = jnp.cumsum(totals) - totals
  before = jnp.cumsum(group_sizes, axis=0) - group_sizes  # [B, G]: earlier batches' rows of g
  within = r[None, :] - jnp.take_along_axis(starts, g, axis=1)
  pos_inside = group_start[g] + jnp.take_along_axis(before, g, axis=1) + within
  outside = ~inside
  tails = jnp.sum(outside, axis=1, dtype=jnp.int32)  # [B]
  tail_start = jnp.sum(totals) + jnp.cumsum(tails) - tails  # [B]
  pos_tail = tail_start[:, None] + jnp.cumsum(outside, axis=1, dtype=jnp.int32) - 1
  return jnp.where(inside, pos_inside, pos_tail).astype(jnp.int32), totals.astype(jnp.int32)


def _inverse(pos):
  flat = pos.reshape(-1)
  return jnp.zeros_like(flat).at[flat].set(jnp.arange(flat.shape[0], dtype=flat.dtype),
                                           unique_indices=True)


def _broadcast(value, batched, axis_size):
  return value if batched else jnp.broadcast_to(value, (axis_size, *value.shape))


def _flat_groups(group_sizes, group_offsets, rows):
  """`[B, G]` groups over `[B, rows]` rows as `[B * G]` groups over `B * rows` rows."""
  batch = group_sizes.shape[0]
  shift = (jnp.arange(batch, dtype=jnp.int32) * rows)[:, None]
  return group_sizes.reshape(-1), (group_offsets + shift).reshape(-1)


@functools.cache
def _product_fn(transpose_w: bool, out_dtype, impl: str):
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
      sizes, offsets = _flat_groups(group_sizes, group_offsets, rows)
      y = product(x.reshape(batch * rows, k), w.reshape(batch * w.shape[1], *w.shape[2:]),
                  sizes, offsets)
      return y.reshape(batch, rows, -1), True
    # Shared weights: rows reordered so that each group holds every element's rows of it.
    pos, totals = _fold_rows_by_group(group_sizes, group_offsets, rows)
    x_sorted = x.reshape(batch * rows, k)[_inverse(pos)]
    y = product(x_sorted, w, totals, jnp.cumsum(totals) - totals)
    return y[pos.reshape(-1)].reshape(batch, rows, -1), True

  return product


@functools.cache
def _weight_grad_fn(transpose_w: bool, w_dtype, impl: str):
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
    sizes, offsets = _flat_groups(group_sizes, group_offsets, rows)
    dw = weight_grad(x.reshape(batch * rows, -1), dy.reshape(batch * rows, -1), sizes, offsets)
    return dw.reshape(batch, groups, *dw.shape[1:]), True

  return weight_grad


# ----------------------------------------------------------------------------------------------
# The differentiable op.

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _grouped_matmul(x, w, group_sizes, group_offsets, transpose_w, out_dtype, impl):
  return _product_fn(transpose_w, out_dtype, impl)(x, w, group_sizes, group_offsets)


def _grouped_matmul_fwd(x, w, group_sizes, group_offsets, transpose_w, out_dtype, impl):
  y = _product_fn(transpose_w, out_dtype, impl)(x, w, group_sizes, group_offsets)
  return y, (x, w, group_sizes, group_offsets)


def _grouped_matmul_bwd(transpose_w, out_dtype, impl, residuals, dy):
  x, w, group_sizes, group_offsets = residuals
  dy = dy.astype(x.dtype)
  dx = _product_fn(not transpose_w, np.dtype(x.dtype), impl)(dy, w, group_sizes, group_offsets)
  dw = _weight_grad_fn(transpose_w, np.dtype(w.dtype), impl)(x, dy, group_sizes, group_offsets)
  # Inside shard_map, weights shared over data axes get the sum of every replica's gradient.
  dx, dw = sum_to_primal(dx, x), sum_to_primal(dw, w)
  float0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  return dx, dw, float0(group_sizes), float0(group_offsets)


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


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
    group_offsets = jnp.cumsum(group_sizes) - group_sizes
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
    impl = _AUTO.get()
  return _grouped_matmul(x, w, group_sizes, group_offsets, bool(transpose_w), out_dtype, impl)
