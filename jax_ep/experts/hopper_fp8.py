"""jax_ep's FP8 grouped GEMM kernels for Hopper GPUs (Pallas Mosaic GPU, e4m3 wgmma), with
DeepSeek-V3's block scaling: activations scaled per row per 128 channels, weights per 128x128
block, each 128-deep block of the reduction "promoted" into an fp32 register accumulator.

Kernels (rows grouped by expert as in `jax_ep/experts/hopper.py`: group g is rows
`[group_offsets[g], group_offsets[g] + group_sizes[g])`, rows between and past the groups are
padding):
- `fp8_grouped_matmul_kernel`: `out[r, n] = sum_kb (x[r, kb] . w[g, n, kb]) * x_scales[r, kb]
  * w_scales[g, n // 128, kb]`, rounded once to `out_dtype`.
- `fp8_gated_kernel`: the gate and up projections of one row operand in one kernel, the gated
  activation in the epilogue, which quantises `h` for the down projection (e4m3 + per-row,
  per-128-column scales, `jax_ep._native.fp8.fp8_quantize`'s rounding) and keeps gate and up
  in bf16 (the backward's residuals).

The weight gradient's FP8 kernel is `hopper_fp8_wgrad.py`'s.

Each has a one-warpgroup form (`emit_pipeline`: load, multiply, promote, store) and a
warp-specialized one (`compute_wgs` 2: a memory warpgroup streams the operands, two
compute warpgroups each multiply and promote half of the tile's rows), over the work list of
`hopper.py` (`layout.row_tiles`: no step for row tiles past the groups).

The FP8 MLP's input gradient of both projections is `fp8_grouped_matmul_kernel` over `[dgate |
dup]` and `[w_gate | w_up]` concatenated along F: one reduction of 2F, on the warp-specialized
form.

Layouts: FP8 wgmma takes both operands K-major (only 16-bit operands may be transposed in
shared memory; lowering says "Only f16 WGMMA supports transposes"), so every weight is stored
with the reduced dimension contiguous: `[G, N, K]`, its scales `[G, N // 128, K // 128]` in
the same order. The forward's `[G, F, H]`-quantised weights serve the gated kernel; the input
gradient reduces over F, so it takes `[G, H, F]` (the bf16 weights' own layout, quantised)
with `[G, H // 128, F // 128]` scales: the 128x128 blocks make each set of scales the other's
transpose. The row scales reach the kernel transposed, `[K // 128, rows]`: a TMA box's row is
at least 16 bytes, and a tile's scales of one block are then one contiguous row.

Promotion (why every 128): Hopper's fp8 wgmma accumulates with fewer bits than fp32 (about
14, DeepSeek-V3's report), so each 128-deep block of the reduction is one wgmma group into a
fresh accumulator (`pl.run_scoped(..., plgpu.ACC)`: zeros); once it has landed, its product is
multiplied by its row scales and its weight block's scale and added to the fp32 totals the
pipeline carries (`init_carry`; the interpreter does not run stores into an accumulator
reference, a carry it does). A column tile never straddles a weight-scale block: `block_n`
divides 128, and `block_k` is 128.

Registers and shared memory: each compute warpgroup holds its totals and one block's product
in registers, `(totals + 1) * rows * block_n / 128` fp32 values per thread for its `block_m /
compute_wgs` rows, kept at most 192 (`REGISTER_LIMIT`) of Hopper's 255; the stages, the
staged outputs and the scales share a CTA's 227 KiB of shared memory (`smem_bytes`). Neither
is caught by lowering on a machine without the GPU, so both are checked when a kernel is
built.

NOTES (rows outside the groups): as in `hopper.py`, a tile reads rows of a neighbouring group
or past the groups (NaN included); their products, scales and epilogue values stay in their
own rows (every operation after the product is row-local), and only the item's own rows are
stored (`hopper._store_rows`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep.experts import compile_ahead
from jax_ep.experts.configs import KernelTiles
from jax_ep.experts.hopper import (TMA_SMEM_ALIGN, _band, _store_rows, launch,
                                   work_item_loop)
from jax_ep.experts.layout import cdiv, row_tiles

# The scales' granularity: a row's scale covers 128 channels, a weight's a 128x128 block.
SCALE_BLOCK = 128
# Shared memory per CTA on Hopper (H100 / H200): 227 KiB.
SMEM_LIMIT = 227 * 1024
# fp32 registers per thread a warpgroup's totals and one block's product may take (of 255):
# the rest holds addresses, the scales and the epilogue's temporaries.
REGISTER_LIMIT = 192
# A staged output's rows are stored from any row of the tile (`hopper._store_rows`: an item's
# rows start anywhere), so each staging buffer's row is a multiple of `TMA_SMEM_ALIGN` bytes,
# checked with the tiles (where the error can name them).
# The h scales' store: each row's scale of a 128-column block is staged in a row of 32 fp32
# columns (`TMA_SMEM_ALIGN` bytes) of a `[rows, F / 128 * 32]` buffer, of which the
# kernel function returns column 0. Only the first 8 columns are written (broadcast: the WGMMA
# layout's narrowest tile, 4 registers a thread where 32 columns take 16); the rest of the row
# is stored as it was in shared memory and never read.
_SCALE_COLUMNS = TMA_SMEM_ALIGN // 4
_SCALE_WRITTEN = 8
_E4M3_MAX = 448.0
_SQRT_2_OVER_PI = 0.7978845608028654
GATED = ("swiglu", "geglu")
ACTIVATIONS = ("swiglu", "geglu", "gelu", "silu")

# A pass: (index of the row operand, ((index of a weight, index of its accumulator), ...)).
Pass = tuple[int, tuple[tuple[int, int], ...]]


def staging(outputs: Sequence[tuple[int, object]], tiles_n: int):
  """`(buffers, slot_of)`: the distinct `(width, dtype)` staging buffers of `outputs` (each
  `(columns, dtype)`, `columns / tiles_n` of them per tile) and each output's buffer. Outputs
  of one width and dtype (the gated kernel's gate and up) share a buffer, one after the other:
  the shared memory goes to the pipeline's stages instead."""
  buffers, slot_of = [], []
  for columns, dtype in outputs:
    key = (columns // tiles_n, jnp.dtype(dtype))
    if key not in buffers:
      buffers.append(key)
    slot_of.append(buffers.index(key))
  return tuple(buffers), tuple(slot_of)


def smem_bytes(tiles: KernelTiles, *, weights: int = 1,
               buffers: Sequence[tuple[int, object]] | None = None) -> int:
  """Shared memory one CTA of these kernels takes: `stages` slots of the row tile, `weights`
  weight tiles and the row scales, plus the staging `buffers` (`(width, dtype)`, `block_m`
  rows in all: each compute warpgroup stages its own rows; default one bf16 output tile).
  (The pipeline's barriers take a few bytes more, within the margin.)"""
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  if buffers is None:
    buffers = ((bn, jnp.bfloat16),)
  stage = bm * bk + weights * bn * bk + bm * 4
  out = sum(bm * width * jnp.dtype(dtype).itemsize for width, dtype in buffers)
  return tiles.stages * stage + out


def _check_tiles(name: str, tiles: KernelTiles, num_accs: int, smem: int,
                 buffers: Sequence[tuple[int, object]]):
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  for width, dtype in buffers:
    if width * jnp.dtype(dtype).itemsize % TMA_SMEM_ALIGN:
      raise ValueError(
          f"{name}: tiles {tiles} stage {width} {jnp.dtype(dtype).name} columns per row, "
          f"{width * jnp.dtype(dtype).itemsize} bytes; a row stored from any row of the tile "
          f"must be a multiple of {TMA_SMEM_ALIGN} bytes (TMA's shared-memory alignment)")
  wgs = tiles.compute_wgs
  if bk != SCALE_BLOCK or SCALE_BLOCK % bn or bm % (64 * wgs):
    raise ValueError(
        f"{name}: tiles must have block_k = {SCALE_BLOCK} (the scales' block), block_n "
        f"dividing {SCALE_BLOCK} (one weight scale per column tile) and block_m a multiple of "
        f"64 * compute_wgs (each compute warpgroup's rows, wgmma's 64); got {tiles}")
  regs = (num_accs + 1) * (bm // wgs) * bn // 128
  if regs > REGISTER_LIMIT:
    raise ValueError(
        f"{name}: tiles {tiles} hold {regs} fp32 registers per thread ({num_accs} totals and a "
        f"block's product of {bm // wgs}x{bn} per warpgroup); at most {REGISTER_LIMIT} fit "
        f"beside the rest")
  if smem > SMEM_LIMIT:
    raise ValueError(f"{name}: tiles {tiles} need {smem} bytes of shared memory per CTA; "
                     f"Hopper has {SMEM_LIMIT}")


def _check_operands(name, x, x_scales, w, w_scales, group_sizes, xname="x", wname="w"):
  """`x` `[rows, K]` e4m3 with `[rows, K / 128]` f32 scales; `w` `[G, N, K]` e4m3 with
  `[G, N / 128, K / 128]` f32 scales. Returns `(rows, K, N)`."""
  if x.ndim != 2 or w.ndim != 3:
    raise ValueError(f"{name}: {xname} must be [rows, K] and {wname} [G, N, K], got "
                     f"{x.shape} and {w.shape}")
  rows, k = x.shape
  groups, n, k2 = w.shape
  for label, a in ((xname, x), (wname, w)):
    if a.dtype != jnp.float8_e4m3fn:
      raise TypeError(f"{name}: {label} must be float8_e4m3fn, got {a.dtype}")
  if k2 != k or k % SCALE_BLOCK or n % SCALE_BLOCK:
    raise ValueError(f"{name}: {xname} {x.shape} and {wname} {w.shape} ([G, N, K]) must share "
                     f"K, and K and N must be multiples of {SCALE_BLOCK}")
  want = {xname + "_scales": (x_scales, (rows, k // SCALE_BLOCK)),
          wname + "_scales": (w_scales, (groups, n // SCALE_BLOCK, k // SCALE_BLOCK))}
  for label, (a, shape) in want.items():
    if a.shape != shape or a.dtype != jnp.float32:
      raise ValueError(f"{name}: {label} must be float32 {shape}, got {a.dtype} {a.shape}")
  if group_sizes.shape != (groups,):
    raise ValueError(f"{name}: group_sizes must be [{groups}] (one per expert of {wname}), "
                     f"got {group_sizes.shape}")
  return rows, k, n


def _row_scales_by_block(x_scales, block_m: int):
  """`[rows, K/128]` -> `[K/128, rows rounded up to block_m]`: a row tile's scales of one
  128-channel block are one contiguous TMA box (a column of `[rows, K/128]` is not: a box's
  row must be 16 bytes)."""
  rows = x_scales.shape[0]
  return jnp.pad(x_scales.T, ((0, 0), (0, cdiv(rows, block_m) * block_m - rows)))


def activation_fn(g, activation: str):
  """`silu(g)` (swiglu, silu) or the tanh-approximated `gelu(g)` (geglu, gelu) in fp32: the
  formulas of the bf16 kernels' epilogue (`jax_ep.experts.mlp.act`)."""
  if activation in ("swiglu", "silu"):
    return g / (1.0 + jnp.exp(-g))
  return 0.5 * g * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)))


def quantize_rows(h):
  """`fp8_quantize`'s rule on a `[block_m, 128]` tile: one scale per row, `amax / 448` (1 for
  an all-zero row), `q = h / scale` rounded to e4m3. Returns `(q, scale [block_m])`."""
  amax = jnp.max(jnp.abs(h), axis=1)
  scale = jnp.where(amax > 0, amax * (1.0 / _E4M3_MAX), 1.0)
  return (h / scale[:, None]).astype(jnp.float8_e4m3fn), scale


# ----------------------------------------------------------------------------------------------
# The public kernels.

def fp8_grouped_matmul_kernel(x, x_scales, w, w_scales, group_sizes, group_offsets=None, *,
                              tiles: KernelTiles, out_dtype=jnp.bfloat16):
  """The block-scaled FP8 grouped GEMM (see the module docstring).

  Args:
    x: `[rows, K]` float8_e4m3fn, grouped by expert.
    x_scales: `[rows, K // 128]` float32, one per row per 128 channels.
    w: `[G, N, K]` float8_e4m3fn: each expert's weights transposed (K contiguous).
    w_scales: `[G, N // 128, K // 128]` float32, one per 128x128 block of `w`.
    group_sizes, group_offsets: `[G]` int32 (offsets default to the groups in a row).
    tiles: `block_k` 128, `block_n` dividing 128; with `compute_wgs` 2 a memory warpgroup
      streams the operands while two compute warpgroups multiply, each `block_m / 2` rows.
    out_dtype: the result's dtype.

  Returns:
    `[rows, N]` `out_dtype`; rows outside the groups unspecified.
  """
  name = "fp8_grouped_matmul_kernel"
  rows, k, n = _check_operands(name, x, x_scales, w, w_scales, group_sizes)
  outputs = ((n, out_dtype),)
  buffers, _ = staging(outputs, n // tiles.block_n)
  _check_tiles(name, tiles, 1, smem_bytes(tiles, buffers=buffers), buffers)
  body = _fused_specialized if tiles.compute_wgs > 1 else _fused
  (out,) = body((x,), (x_scales,), (w,), (w_scales,), group_sizes, group_offsets,
                passes=((0, ((0, 0),)),), tiles=tiles, epilogue=lambda totals: totals,
                outputs=outputs, name="jax_ep_fp8_gmm")
  return out


def fp8_gated_kernel(x, x_scales, w_gate, w_up, scales_gate, scales_up, group_sizes,
                     group_offsets=None, *, activation: str, tiles: KernelTiles):
  """Gate and up projections with the activation in the epilogue, `h` quantised to e4m3.

  Args:
    x, x_scales: `[rows, H]` e4m3, `[rows, H // 128]` f32.
    w_gate, w_up: `[G, F, H]` e4m3 (K-major); `w_up` None for "gelu" / "silu".
    scales_gate, scales_up: `[G, F // 128, H // 128]` f32 (None with `w_up`).
    group_sizes, group_offsets: `[G]` int32.
    activation: "swiglu", "geglu" (`act(gate) * up`), "gelu" or "silu" (`act(gate)`).
    tiles: `block_n` 128 (the quantisation's amax is then row-local to the tile).

  Returns:
    `(h, h_scales, gate, up)`: `h` `[rows, F]` e4m3 and `h_scales` `[rows, F // 128]` f32
    (`fp8_quantize`'s rounding of the fp32 activation), `gate` and `up` `[rows, F]` bf16 (the
    fp32 projections rounded once; `up` None without `w_up`). Rows outside the groups
    unspecified.
  """
  name = "fp8_gated_kernel"
  if activation not in ACTIVATIONS:
    raise ValueError(f"{name}: activation must be one of {ACTIVATIONS}, got {activation!r}")
  gated = activation in GATED
  if gated != (w_up is not None) or (w_up is None) != (scales_up is None):
    raise ValueError(f"{name}: activation {activation!r} takes "
                     f"{'w_up and scales_up' if gated else 'no w_up / scales_up'}")
  rows, _, f = _check_operands(name, x, x_scales, w_gate, scales_gate, group_sizes,
                               wname="w_gate")
  ws, w_scales = (w_gate,), (scales_gate,)
  if gated:
    _check_operands(name, x, x_scales, w_up, scales_up, group_sizes, wname="w_up")
    if w_up.shape != w_gate.shape:
      raise ValueError(f"{name}: w_up {w_up.shape} must match w_gate {w_gate.shape}")
    ws, w_scales = (w_gate, w_up), (scales_gate, scales_up)
  if tiles.block_n != SCALE_BLOCK:
    raise ValueError(f"{name}: tiles must have block_n = {SCALE_BLOCK} (h's scale block), got "
                     f"{tiles}")
  num = len(ws)
  outputs = (((f, jnp.float8_e4m3fn), (f // SCALE_BLOCK * _SCALE_COLUMNS, jnp.float32))
             + ((f, jnp.bfloat16),) * num)
  buffers, _ = staging(outputs, f // SCALE_BLOCK)
  _check_tiles(name, tiles, num, smem_bytes(tiles, weights=num, buffers=buffers),
               buffers)

  def epilogue(totals):
    h = activation_fn(totals[0], activation)
    if gated:
      h = h * totals[1]
    q, scale = quantize_rows(h)
    wide = jnp.broadcast_to(scale[:, None], (scale.shape[0], _SCALE_WRITTEN))
    return (q, wide, *totals)

  body = _fused_specialized if tiles.compute_wgs > 1 else _fused
  outs = body((x,), (x_scales,), ws, w_scales, group_sizes, group_offsets,
              passes=((0, tuple((i, i) for i in range(num))),), tiles=tiles,
              epilogue=epilogue, outputs=outputs, name="jax_ep_fp8_gate_up")
  h, wide = outs[0], outs[1]
  h_scales = wide.reshape(rows, f // SCALE_BLOCK, _SCALE_COLUMNS)[:, :, 0]
  return h, h_scales, outs[2], outs[3] if gated else None


# ----------------------------------------------------------------------------------------------
# The bodies.

def _promote(total, part, row_scales, w_scale):
  """`total + part * row_scales * w_scale`: one 128-deep block's product, scaled, into the
  fp32 total (the row scales are a `[rows]` row of the pipeline's scale slot)."""
  return total + part * (row_scales * w_scale)[:, None]


def _store_outputs(values, buffers, slot_of, out_refs, widths, row0, first, count, ni,
                   block_m: int, rows: int):
  """Stages each value in its buffer and stores rows `[first, first + count)` of it (at row
  `row0 + ...`, column tile `ni`); a buffer that an earlier output of this epilogue used is
  reused once that output's store has read it. The last stores are left in flight. A value
  narrower than its buffer fills its first columns (the rest is stored unwritten)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  used = set()
  for value, slot, o_ref, width in zip(values, slot_of, out_refs, widths):
    if slot in used:
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    used.add(slot)
    staged = buffers[slot]
    if value.shape[-1] < width:
      staged = staged.at[:, pl.ds(0, value.shape[-1])]
    staged[...] = value.astype(staged.dtype)
    plgpu.commit_smem()
    _store_rows(buffers[slot], o_ref, row0, first, count, ni * width, block_m, width, rows)


def _prepare(xs, x_scales, ws, group_sizes, group_offsets, passes, tiles, outputs):
  """What both bodies compute before the kernel: the work list, the row scales' layout, the
  number of totals, each output's width per tile and the staging buffers."""
  rows = xs[0].shape[0]
  tiles_n = ws[0].shape[1] // tiles.block_n
  table = row_tiles(group_sizes, rows, tiles.block_m, group_offsets)
  scales_t = tuple(_row_scales_by_block(s, tiles.block_m) for s in x_scales)
  num_accs = 1 + max(a for _, targets in passes for _, a in targets)
  widths = tuple(columns // tiles_n for columns, _ in outputs)
  buffers, slot_of = staging(outputs, tiles_n)
  return rows, tiles_n, table, scales_t, num_accs, widths, buffers, slot_of


def _fused(xs, x_scales, ws, w_scales, group_sizes, group_offsets, *, passes: Sequence[Pass],
           tiles: KernelTiles, epilogue: Callable, outputs: Sequence[tuple[int, object]],
           name: str):
  """One warpgroup per CTA over the work list (`layout.row_tiles`): for each (item, column
  tile), each pass runs an `emit_pipeline` over its row operand's 128-deep blocks, multiplying
  the row tile by each of its weights' tiles into that weight's total (one wgmma group at a
  time: a total, not a second product, is what stays in registers), then `epilogue(totals)`
  gives `[block_m, columns / tiles_n]` values per output `(columns, dtype)`, stored for the
  item's rows only."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  rows, tiles_n, table, scales_t, num_accs, widths, buffers, slot_of = _prepare(
      xs, x_scales, ws, group_sizes, group_offsets, passes, tiles, outputs)
  band = _band(tiles.band, tiles_n)
  num_x, num_w = len(xs), len(ws)

  def body(tile_gmem, group_gmem, first_gmem, count_gmem, num_gmem, *refs):
    x_refs = refs[:num_x]
    s_refs = refs[num_x:2 * num_x]
    w_refs = refs[2 * num_x:2 * num_x + num_w]
    ws_refs = refs[2 * num_x + num_w:2 * num_x + 2 * num_w]
    out_refs = refs[2 * num_x + 2 * num_w:]

    @work_item_loop(tile_gmem, group_gmem, num_gmem, tiles_n, band)
    def _(item, ni, tile, group):
      block_n = ni * bn // SCALE_BLOCK
      totals = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(num_accs))
      for xi, targets in passes:
        def step(idx, x_smem, s_smem, *w_smems_and_carry, targets=targets):
          *w_smems, carry = w_smems_and_carry
          carry = list(carry)
          row_scales = s_smem[0]
          # The slot is refilled by TMA (the async proxy) once this step ends: the read of
          # it in the generic proxy is committed first.
          plgpu.commit_smem()
          for (wi, ai), w_smem in zip(targets, w_smems):
            # Read before the product is issued, so that the load overlaps the wgmma.
            w_scale = ws_refs[wi][group, block_n, idx[0]]

            def product(part_ref, w_smem=w_smem):
              plgpu.wgmma(part_ref, x_smem, w_smem.transpose((1, 0)))
              return part_ref[...]
            part = pl.run_scoped(product, plgpu.ACC((bm, bn)))
            carry[ai] = _promote(carry[ai], part, row_scales, w_scale)
          return tuple(carry)

        totals = plgpu.emit_pipeline(
            step,
            grid=(xs[xi].shape[1] // bk,),
            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (tile, kk)),
                      plgpu.BlockSpec((1, bm), lambda kk: (kk, tile))]
            + [plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk))] * len(targets),
            max_concurrent_steps=tiles.stages,
            init_carry=totals,
        )(x_refs[xi], s_refs[xi], *(w_refs[wi].at[group] for wi, _ in targets))
      values = epilogue(totals)

      @functools.partial(pl.run_scoped, smems=[plgpu.SMEM((bm, width), dtype)
                                               for width, dtype in buffers])
      def _(smems):
        _store_outputs(values, smems, slot_of, out_refs, widths, tile * bm, first_gmem[item],
                       count_gmem[item], ni, bm, rows)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return launch(body, name, tuple(jax.ShapeDtypeStruct((rows, columns), dtype)
                                 for columns, dtype in outputs), tiles,
                (*table, *xs, *scales_t, *ws, *w_scales),
                settings=(tuple(passes), compile_ahead.code_key(epilogue)))


def _fused_specialized(xs, x_scales, ws, w_scales, group_sizes, group_offsets, *,
                       passes: Sequence[Pass], tiles: KernelTiles, epilogue: Callable,
                       outputs: Sequence[tuple[int, object]], name: str):
  """`_fused` warp-specialized, for one pass: a memory warpgroup streams the row tile, its
  scales and the weights' column tiles into a ring of `stages` slots, while `compute_wgs`
  warpgroups each multiply and promote `block_m / compute_wgs` rows of the tile (one promotes
  while another's wgmma runs: what hides the promotion's wait, DeepGEMM's two math
  warpgroups), then stage and store their item's rows, waiting only for their own previous
  stores."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if len(passes) != 1:
    raise ValueError("the warp-specialized FP8 kernel runs one pass")
  (xi, targets), = passes
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  wgs = tiles.compute_wgs
  part_m = bm // wgs
  k = xs[xi].shape[1]
  rows, tiles_n, table, scales_t, num_accs, widths, buffers, slot_of = _prepare(
      xs, x_scales, ws, group_sizes, group_offsets, passes, tiles, outputs)
  band = _band(tiles.band, tiles_n)
  # e4m3 rows of 128 channels: 128 bytes, the 128-byte swizzle.
  transforms = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
  weights = [ws[wi] for wi, _ in targets]
  weight_scales = [w_scales[wi] for wi, _ in targets]

  def body(tile_gmem, group_gmem, first_gmem, count_gmem, num_gmem, x_gmem, s_gmem, *refs):
    w_refs = refs[:len(weights)]
    ws_refs = refs[len(weights):2 * len(weights)]
    out_refs = refs[2 * len(weights):]

    def pipeline(tile, ni, mma_body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          mma_body,
          grid=(k // bk,),
          memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((bm, bk), lambda kk: (tile, kk), transforms=transforms,
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((1, bm), lambda kk: (kk, tile), memory_space=plgpu.SMEM),
          ] + [plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), transforms=transforms,
                               memory_space=plgpu.SMEM)] * len(weights),
          wg_axis="wg",
          num_compute_wgs=wgs,
          max_concurrent_steps=tiles.stages,
          compute_context=compute_context,
      )

    ignore = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(0, 0, ignore, ignore).get_allocations(
            x_gmem, s_gmem, *(w.at[0] for w in w_refs)),
        smems=[plgpu.SMEM((wgs, part_m, width), dtype) for width, dtype in buffers],
        collective_axes="wg")
    def _(allocations, smems):
      wg = lax.axis_index("wg")
      own_rows = pl.ds(wg * part_m, part_m)

      @work_item_loop(tile_gmem, group_gmem, num_gmem, tiles_n, band)
      def _(item, ni, tile, group):
        block_n = ni * bn // SCALE_BLOCK

        def compute_context(eval_pipeline):
          totals = eval_pipeline(tuple(jnp.zeros((part_m, bn), jnp.float32)
                                       for _ in range(num_accs)))
          values = epilogue(totals)
          # This warpgroup's rows of the item: [first, first + count) of the tile, cut to its
          # own part.
          first, count = first_gmem[item], count_gmem[item]
          lo = jnp.clip(first - wg * part_m, 0, part_m)
          hi = jnp.clip(first + count - wg * part_m, 0, part_m)
          # The previous item's stores out of this warpgroup's buffers have read them.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          _store_outputs(values, [b.at[wg] for b in smems], slot_of, out_refs, widths,
                         tile * bm + wg * part_m, lo, hi - lo, ni, part_m, rows)

        def mma_body(idx, x_smem, s_smem, *w_smems_and_carry):
          *w_smems, carry = w_smems_and_carry
          carry = list(carry)
          # The scales are read before the products are issued: the weights' (from global
          # memory) overlap them.
          row_scales = s_smem[0, own_rows]
          # The memory warpgroup refills the slot by TMA (the async proxy) once this step has
          # released it: the read of it in the generic proxy is committed first.
          plgpu.commit_smem()
          w_scales_now = [ws_ref[group, block_n, idx[0]] for ws_ref in ws_refs]
          for (_, ai), w_smem, w_scale in zip(targets, w_smems, w_scales_now):
            def product(part_ref, w_smem=w_smem):
              plgpu.wgmma(part_ref, x_smem.at[own_rows], w_smem.transpose((1, 0)))
              return part_ref[...]
            part = pl.run_scoped(product, plgpu.ACC((part_m, bn)))
            carry[ai] = _promote(carry[ai], part, row_scales, w_scale)
          return tuple(carry)

        pipeline(tile, ni, mma_body, compute_context)(
            x_gmem, s_gmem, *(w.at[group] for w in w_refs), allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return launch(body, f"{name}_ws", tuple(jax.ShapeDtypeStruct((rows, columns), dtype)
                                         for columns, dtype in outputs), tiles,
                (*table, xs[xi], scales_t[xi], *weights, *weight_scales), threads=wgs + 1,
                settings=(tuple(passes), compile_ahead.code_key(epilogue)))
