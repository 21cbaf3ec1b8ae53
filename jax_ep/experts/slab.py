"""The SwiGLU experts on the low-latency slabs, stopping at each expert's count.

The low-latency dispatch leaves expert `l`'s rows at the front of slab `l` of `[L, S, H]`
(`S = R * T_max`, `count[l]` rows; the rest unspecified). A batched matmul over whole slabs
computes every padding row too: `L * S` rows where decode routes `T * K` (32× the work at
T=128, top-8 of 256 experts, on one rank or eight). These kernels compute only the row tiles
that hold rows: `gate_up` (both projections and `silu(gate) * up` in one pass over `x`) and
`down`, each a Pallas kernel over (expert, row tile, column tile) whose tiles past `count[l]`
do nothing; the tiles follow the slab size (`jax_ep.experts.configs.SLAB_TILE_RULE`). Rows
past `count[l]` inside a computed tile come out zero; tiles past it are left unwritten (the
combine reads rows below `count` only).

Gradients are those of the dense formulation (`dense_mlp`, masked rows), through a
`jax.custom_vjp`: decode rarely differentiates, and the backward then stays what it was.
`impl`: "auto" (the kernels on GPUs for bf16 / f16 slabs whose sizes the tiles divide, else the
dense formulation), "pallas", "interpret" (the kernels in Pallas's interpreter, for tests on the
CPU) or "dense".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ep._native.varying import vary_like_operands
from jax_ep.experts.configs import SlabTiles, slab_divides, slab_tiles, smallest_slab_tiles
from jax_ep.experts.layout import rows_below_count

_KERNEL_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def dense_mlp(rows, w_gate, w_up, w_down, count):
  """The reference formulation: padding rows masked to zero, then batched matmuls over whole
  slabs (fp32 accumulation, the hidden activation rounded to the rows' dtype)."""
  f32 = jnp.float32
  used = rows_below_count(count, rows.shape[1])
  x = jnp.where(used, rows, jnp.zeros((), rows.dtype))
  gate = jnp.einsum("lsh,lhf->lsf", x, w_gate, preferred_element_type=f32)
  up = jnp.einsum("lsh,lhf->lsf", x, w_up, preferred_element_type=f32)
  h = (jax.nn.silu(gate) * up).astype(x.dtype)
  return jnp.einsum("lsf,lfh->lsh", h, w_down, preferred_element_type=f32).astype(x.dtype)


def kernel_fits(rows_shape, ffn: int, dtype) -> str | None:
  """Why the kernels cannot take these slabs, or None when they can."""
  _, s, h = rows_shape
  if np.dtype(dtype) not in _KERNEL_DTYPES:
    return f"dtype {np.dtype(dtype).name} (the kernels take bfloat16 and float16)"
  if slab_tiles(s, h, ffn) is None:
    return slab_divides(smallest_slab_tiles(), s, h, ffn)
  return None


def _projection_kernel(x_ref, *refs, gated: bool, num_k: int, block_k: int):
  """One (expert, row tile, column tile): `silu(x @ w_gate) * (x @ w_up)` (gated) or
  `x @ w`, fp32 accumulation, over the rows below count; nothing for a tile past them."""
  from jax.experimental.pallas import triton as plgpu
  from jax.experimental import pallas as pl
  if gated:
    wg_ref, wu_ref, count_ref, out_ref = refs
  else:
    wg_ref, count_ref, out_ref = refs
    wu_ref = None
  block_m, block_n = out_ref.shape
  first = pl.program_id(1) * block_m
  n = count_ref[0]

  @pl.when(first < n)
  def _():
    row_mask = (first + jnp.arange(block_m, dtype=jnp.int32) < n)[:, None]

    def body(k, accs):
      cols = pl.ds(k * block_k, block_k)
      x = plgpu.load(x_ref.at[:, cols], mask=row_mask, other=0.0)
      out = [accs[0] + plgpu.dot(x, plgpu.load(wg_ref.at[cols, :]))]
      if gated:
        out.append(accs[1] + plgpu.dot(x, plgpu.load(wu_ref.at[cols, :])))
      return tuple(out)
    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = lax.fori_loop(0, num_k, body, (zeros, zeros) if gated else (zeros,))
    value = jax.nn.silu(accs[0]) * accs[1] if gated else accs[0]
    plgpu.store(out_ref, value.astype(out_ref.dtype))


def _projection(x, weights, count, tiles: SlabTiles, *, interpret: bool):
  """`[L, S, K] x [L, K, N] -> [L, S, N]` over the rows below count (gated with two weights)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  num_local, slab, k = x.shape
  n = weights[0].shape[2]
  bm, bn = tiles.block_m, tiles.block_n
  grid = (num_local, slab // bm, n // bn)
  kernel = functools.partial(_projection_kernel, gated=len(weights) == 2,
                             num_k=k // tiles.block_k, block_k=tiles.block_k)
  in_specs = [pl.BlockSpec((None, bm, k), lambda l, i, j: (l, i, 0))]
  in_specs += [pl.BlockSpec((None, k, bn), lambda l, i, j: (l, 0, j)) for _ in weights]
  in_specs.append(pl.BlockSpec((1,), lambda l, i, j: (l,)))
  # NOTES: inside shard_map a pallas_call's result must be given its varying axes: those of
  # the operands (all of them cast to the union, so that the kernel sees one type).
  x, *weights, count = vary_like_operands((x, *weights, count), (x, *weights, count))
  manual = getattr(jax.typeof(x), "manual_axis_type", None)
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bm, bn), lambda l, i, j: (l, i, j)),
      out_shape=jax.ShapeDtypeStruct((num_local, slab, n), x.dtype, manual_axis_type=manual),
      compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                           num_stages=tiles.num_stages),
      interpret=interpret, name="jax_ep_slab_gate_up" if len(weights) == 2 else "jax_ep_slab_down",
  )(x, *weights, count.astype(jnp.int32))


def _kernel_mlp(rows, w_gate, w_up, w_down, count, tiles, interpret):
  h = _projection(rows, (w_gate, w_up), count, tiles, interpret=interpret)
  return _projection(h, (w_down,), count, tiles, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _mlp(rows, w_gate, w_up, w_down, count, tiles, interpret):
  return _kernel_mlp(rows, w_gate, w_up, w_down, count, tiles, interpret)


def _mlp_fwd(rows, w_gate, w_up, w_down, count, tiles, interpret):
  out = _kernel_mlp(rows, w_gate, w_up, w_down, count, tiles, interpret)
  return out, (rows, w_gate, w_up, w_down, count)


def _mlp_bwd(tiles, interpret, residuals, d_out):
  rows, w_gate, w_up, w_down, count = residuals
  _, vjp = jax.vjp(lambda r, g, u, d: dense_mlp(r, g, u, d, count), rows, w_gate, w_up, w_down)
  # Rows past count are unspecified in the output: their cotangent contributes nothing.
  used = rows_below_count(count, rows.shape[1])
  d_rows, d_gate, d_up, d_down = vjp(jnp.where(used, d_out, jnp.zeros((), d_out.dtype)))
  return d_rows, d_gate, d_up, d_down, np.zeros(count.shape, jax.dtypes.float0)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def resolve_impl(impl: str, rows_shape, ffn: int, dtype) -> str:
  """The implementation `impl` means for these slabs ('pallas', 'interpret' or 'dense')."""
  if impl not in ("auto", "pallas", "interpret", "dense"):
    raise ValueError(f"jax_ep.expert_mlp_slabs: impl must be 'auto', 'pallas', 'interpret' or "
                     f"'dense', got {impl!r}")
  if impl == "auto":
    if jax.default_backend() != "gpu":
      return "dense"
    return "dense" if kernel_fits(rows_shape, ffn, dtype) is not None else "pallas"
  if impl in ("pallas", "interpret"):
    why = kernel_fits(rows_shape, ffn, dtype)
    if why is not None:
      raise ValueError(f"jax_ep.expert_mlp_slabs: impl={impl!r} cannot take these slabs: {why}")
  return impl


def slab_mlp(rows, w_gate, w_up, w_down, count, impl: str = "auto"):
  """`[L, S, H] -> [L, S, H]`: expert `l`'s SwiGLU on its slab's first `count[l]` rows (rows
  past them: zero in the dense formulation, unspecified in the kernels')."""
  name = resolve_impl(impl, rows.shape, w_gate.shape[2], rows.dtype)
  if name == "dense":
    return dense_mlp(rows, w_gate, w_up, w_down, count)
  tiles = slab_tiles(rows.shape[1], rows.shape[2], w_gate.shape[2])
  return _mlp(rows, w_gate, w_up, w_down, count.astype(jnp.int32), tiles, name == "interpret")
