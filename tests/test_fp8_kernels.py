"""jax_ep's FP8 grouped GEMM kernels (jax_ep/experts/hopper_fp8.py) against oracles of the
dequantised operands.

Three checks, from cheapest to the real thing:
- interpreted: the kernels run in Pallas's Mosaic GPU interpreter on the CPU at small tiles
  (the work list, the promotion every 128, the epilogues, the stores that stop at the groups)
  against a float64 oracle, with NaN in every row outside the groups (rows and scales);
- cross-lowered: each kernel lowered for CUDA at the five model shapes with the tiles
  `configs` picks, which runs Mosaic GPU's own checks (wgmma's operand layouts and dtypes,
  TMA boxes, the layouts of the epilogue's values) without a GPU. Shared memory and registers
  are checked by the kernels themselves (`smem_bytes`, `REGISTER_LIMIT`), not by lowering;
- `gpu`: the compiled kernels on a Hopper GPU at the five model shapes.

The bounds (`|got - want| <= REL * |want| + ABS * sum_abs`, `sum_abs` the same product of the
operands' absolute values):
- REL = 2^-8: the one rounding of the fp32 total to bf16 (8 significant bits: half an ulp is at
  most 2^-8 of the value);
- ABS: the fp32 arithmetic before it. In the interpreter the products of e4m3 values are exact
  and the sums fp32 (a 128-deep block, the promotion's two products and add: far below 2^-16
  of the absolute sum). On Hopper the fp8 wgmma accumulates inside a 128-deep block with fewer
  bits than fp32 (DeepSeek-V3's report: about 14), which is why the kernels promote every 128:
  2^-12 of the absolute sum bounds it.
"""

import contextlib
import functools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from ep_test_base import require_hopper
from jax_ep import experts
from jax_ep._native.fp8 import fp8_quantize
from jax_ep.experts import configs, hopper_fp8, hopper_fp8_wgrad, mlp
from jax_ep.experts.configs import KernelTiles
from jax_ep.experts.layout import rows_inside_groups

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REL = 2.0 ** -8
ABS_INTERPRETED = 2.0 ** -16
ABS_HOPPER = 2.0 ** -12
# The weight gradient's reduction runs over tokens, and a 128-token block's tokens may span
# 2^12 in magnitude (rows' scales differ; a channel's features do not): Hopper's FP8 MMA adds
# a step's products at about 14 bits aligned to the largest, so the small ones lose more than
# along a row. On an H100 its misses of 2^-12 all lay within 2^-10 of `sum |a||b|`; a wrong
# scale, block or group errs by the order of the value.
ABS_HOPPER_WGRAD = 2.0 ** -10
# Tiles for the interpreter: the one-warpgroup form with 64-row items (two per 128-row tile
# of the layout) and the warp-specialized one (two compute warpgroups of 64 rows each).
PLAIN = KernelTiles(64, 128, 128, 2, 1, 1)
SPECIALIZED = KernelTiles(128, 128, 128, 2, 1, 2)
BOTH = pytest.mark.parametrize("tiles", [PLAIN, SPECIALIZED], ids=["one-warpgroup",
                                                                   "specialized"])
MODEL_SHAPES = [  # (G, H, F)
    (256, 7168, 2048),  # DeepSeek-V3
    (128, 2048, 768),  # Qwen3-30B-A3B
    (32, 4096, 1536),
    (8, 4096, 14336),  # Mixtral 8x7B
    (32, 7168, 2048),  # DeepSeek-V3 at EP=8, one rank
]
SHAPE_IDS = ["deepseek-v3", "qwen3-30b-a3b", "32x4096x1536", "mixtral", "deepseek-v3-ep8"]


# ------------------------------------------------------------------ operands and oracles

def quantize_weights(w):
  """`[G, N, K]` float -> e4m3 `[G, N, K]` and `[G, N/128, K/128]` f32 block scales (amax /
  448 per 128x128 block, 1 for an all-zero block)."""
  g, n, k = w.shape
  blocks = jnp.asarray(w, jnp.float32).reshape(g, n // 128, 128, k // 128, 128)
  amax = jnp.max(jnp.abs(blocks), axis=(2, 4))
  scales = jnp.where(amax > 0, amax / 448.0, 1.0).astype(jnp.float32)
  q = (blocks / scales[:, :, None, :, None]).astype(jnp.float8_e4m3fn)
  return q.reshape(g, n, k), scales


def dequantize_rows(q, scales):
  return np.asarray(q, np.float64) * np.repeat(np.asarray(scales, np.float64), 128, axis=1)


def dequantize_expert(q, scales):
  """One expert's `[N, K]` e4m3 weights and `[N/128, K/128]` scales, in float64."""
  s = np.repeat(np.repeat(np.asarray(scales, np.float64), 128, axis=0), 128, axis=1)
  return np.asarray(q, np.float64) * s


def layout(sizes, alignment=128):
  """Offsets aligned to `alignment` (gaps between groups) for `sizes`, and the rows they need."""
  sizes = np.asarray(sizes, np.int32)
  padded = -(-sizes // alignment) * alignment
  offsets = (np.cumsum(padded) - padded).astype(np.int32)
  return jnp.asarray(sizes), jnp.asarray(offsets), int(padded.sum())


def row_operand(rng, rows, k, gs, go, fill=np.nan):
  """e4m3 rows and their scales (`fp8_quantize` of normal values, rows scaled by 2^-6 ... 2^6
  so that the scales differ), with `fill` in every row outside the groups. Drawn on the
  device (jax.random): the model shapes' operands are large."""
  keys = jax.random.split(jax.random.key(int(rng.integers(2 ** 31))))
  x = jax.random.normal(keys[0], (rows, k), jnp.float32) * jnp.exp2(
      jax.random.randint(keys[1], (rows, 1), -6, 7).astype(jnp.float32))
  q, s = fp8_quantize(x)
  inside = rows_inside_groups(gs, go, rows)
  q = jnp.where(inside[:, None], q, jnp.asarray(fill, jnp.float8_e4m3fn))
  s = jnp.where(inside[:, None], s, jnp.asarray(fill, jnp.float32))
  return q, s


def weight_operand(rng, groups, n, k):
  key = jax.random.key(int(rng.integers(2 ** 31)))
  return jax.jit(quantize_weights)(jax.random.normal(key, (groups, n, k), jnp.float32)
                                   * k ** -0.5)


def oracle(xs, ws, gs, go):
  """`(sum_i x_i @ w_i[g]^T, sum_i |x_i| @ |w_i[g]|^T)` in float64 over each group's rows
  (dequantised `(q, scales)` pairs; zero outside the groups)."""
  rows = xs[0][0].shape[0]
  n = ws[0][0].shape[1]
  out, absolute = np.zeros((rows, n)), np.zeros((rows, n))
  xd = [dequantize_rows(*x) for x in xs]
  for g, (start, size) in enumerate(zip(np.asarray(go), np.asarray(gs))):
    r = slice(int(start), int(start + size))
    if not size:
      continue
    for x, (wq, wsc) in zip(xd, ws):
      w = dequantize_expert(wq[g], wsc[g])
      out[r] += x[r] @ w.T
      absolute[r] += np.abs(x[r]) @ np.abs(w).T
  return out, absolute


def oracle_on_device(xs, ws, gs, go, chunk: int = 8):
  """`oracle` for the model shapes, on the device, in float32 at HIGHEST precision: per 128-row
  tile (the layouts align each group to 128 rows, so a tile holds one group's rows and its
  padding), `chunk` tiles at a time with their experts' dequantised weights gathered. NOTES:
  not a `lax.ragged_dot` of float32 operands, which XLA expands on GPUs into a dense masked
  product over every group (DeepSeek-V3's 256: hundreds of GB); float32, not float64: its sums'
  error (about sqrt(K) * 2^-24 of the absolute sum) is far below the bounds."""
  rows = xs[0][0].shape[0]
  assert rows % 128 == 0, rows
  tiles = rows // 128
  padded_tiles = -(-tiles // chunk) * chunk
  offsets = np.asarray(go)
  # A tile's group: the last with its first row at or before the tile's (an empty group shares
  # its offset with the next one, which owns the rows).
  tile_group = np.maximum(np.searchsorted(offsets, np.arange(padded_tiles) * 128,
                                          side="right") - 1, 0).astype(np.int32)

  @jax.jit
  def products(xq, xsc, wq, wsc, tile_group):
    k = xq.shape[1]
    xd = xq.astype(jnp.float32) * jnp.repeat(xsc, 128, axis=1)
    xd = jnp.pad(xd, ((0, (padded_tiles - tiles) * 128), (0, 0)))
    xd = xd.reshape(padded_tiles // chunk, chunk, 128, k)

    def one_chunk(args):
      x, groups = args
      w = wq[groups].astype(jnp.float32) * jnp.repeat(
          jnp.repeat(wsc[groups], 128, axis=1), 128, axis=2)  # [chunk, N, K]
      dot = functools.partial(jnp.einsum, "tmk,tnk->tmn",
                              precision=jax.lax.Precision.HIGHEST)
      return dot(x, w), dot(jnp.abs(x), jnp.abs(w))
    out, absolute = jax.lax.map(one_chunk, (xd, tile_group.reshape(-1, chunk)))
    n = wq.shape[1]
    return out.reshape(-1, n)[:rows], absolute.reshape(-1, n)[:rows]
  out, absolute = 0.0, 0.0
  for x, w in zip(xs, ws):
    o, a = products(*x, *w, jnp.asarray(tile_group))
    out, absolute = out + np.asarray(o, np.float64), absolute + np.asarray(a, np.float64)
  return out, absolute


def test_the_device_oracle_matches_the_float64_one():
  """The GPU tests' oracle (per tile, float32) against the float64 one on a small layout with
  an empty group, two operand pairs as the input gradient has them."""
  rng = np.random.default_rng(5)
  gs, go, rows = layout([150, 0, 37, 256, 1])
  xs = [row_operand(rng, rows, 256, gs, go, fill=0.0) for _ in range(2)]
  ws = [weight_operand(rng, 5, 384, 256) for _ in range(2)]
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  want, want_abs = oracle(xs, ws, gs, go)
  got, got_abs = oracle_on_device(xs, ws, gs, go, chunk=3)
  np.testing.assert_allclose(got[inside], want[inside], rtol=1e-5, atol=1e-5 * want_abs.max())
  np.testing.assert_allclose(got_abs[inside], want_abs[inside], rtol=1e-5)


def assert_within(got, want, absolute, inside, what, abs_bound=ABS_INTERPRETED):
  got = np.asarray(got, np.float64)[inside]
  want, absolute = want[inside], absolute[inside]
  assert np.isfinite(got).all(), f"{what}: not finite inside the groups"
  err = np.abs(got - want)
  bound = REL * np.abs(want) + abs_bound * absolute
  worst = np.unravel_index(np.argmax(err - bound), err.shape)
  assert (err <= bound).all(), (f"{what}: |got - want| = {err[worst]} > {bound[worst]} at "
                                f"{worst} (want {want[worst]})")


# The largest slope of the activations' functions (GELU's tanh form: about 1.13; SiLU's 1.10).
_ACT_SLOPE = 1.13


def e4m3_step(m):
  """The spacing of e4m3 values at magnitude `m` (normal from 2^-6, subnormal 2^-9 below)."""
  m = np.maximum(np.abs(m), 2.0 ** -6)
  return np.exp2(np.floor(np.log2(m)) - 3)


# ------------------------------------------------------------------ interpreted

SIZES = [150, 0, 37, 256, 1]  # skewed, one empty, one of a single row; offsets aligned to 128


@contextlib.contextmanager
def interpret(kernel_sms=8):
  """The interpreter, the persistent kernels on a grid of `kernel_sms` CTAs (None: a device's
  132). It runs every CTA of a grid, idle ones too, so 132 would be most of a test's time; 8
  are fewer than these tests' items, each CTA taking several."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  with plgpu.force_gpu_interpret_mode(), experts.override(kernel_sms=kernel_sms):
    yield


@BOTH
def test_matmul_matches_the_dequantised_oracle(tiles):
  """On a device's grid: most of its CTAs find no item (the persistent loop ends at once)."""
  rng = np.random.default_rng(0)
  gs, go, rows = layout(SIZES)
  x, xs = row_operand(rng, rows, 256, gs, go)
  w, ws = weight_operand(rng, len(SIZES), 256, 256)
  with interpret(kernel_sms=None):
    got = hopper_fp8.fp8_grouped_matmul_kernel(x, xs, w, ws, gs, go, tiles=tiles)
  assert got.shape == (rows, 256) and got.dtype == jnp.bfloat16
  want, absolute = oracle([(x, xs)], [(w, ws)], gs, go)
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  assert_within(got, want, absolute, inside, "fp8 matmul")


@BOTH
def test_few_ctas_each_run_many_items(tiles):
  """Two CTAs for the whole work list (on Hopper: one per SM, many items each): the pipeline's
  slots, the staging buffers' reuse and the carries across items, which 132 CTAs of a small
  case would not reach."""
  rng = np.random.default_rng(9)
  gs, go, rows = layout(SIZES)
  x, xs = row_operand(rng, rows, 384, gs, go)
  w_gate, w_up = weight_operand(rng, len(SIZES), 256, 384), weight_operand(
      rng, len(SIZES), 256, 384)
  with interpret(), experts.override(kernel_sms=2):
    got = hopper_fp8.fp8_grouped_matmul_kernel(x, xs, *w_gate, gs, go, tiles=tiles)
    outs = hopper_fp8.fp8_gated_kernel(x, xs, w_gate[0], w_up[0], w_gate[1], w_up[1], gs, go,
                                       activation="swiglu", tiles=tiles)
  want, absolute = oracle([(x, xs)], [w_gate], gs, go)
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  assert_within(got, want, absolute, inside, "fp8 matmul, two CTAs")
  check_gated(outs, x, xs, w_gate, w_up, gs, go, "swiglu", ABS_INTERPRETED)


@BOTH
def test_the_interpreters_race_detector_finds_no_race(tiles):
  """Two CTAs, many items each, under the interpreter's happens-before race detector: the
  pipeline's slots (TMA writes, the scales' reads), the staging buffers and the stores, of
  each kernel."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call, params
  except ImportError:  # the detector's module moved: this jax does not offer it here
    pytest.skip("this jax has no Mosaic GPU race detector at the expected place")
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rng = np.random.default_rng(10)
  gs, go, rows = layout(SIZES)
  x, xs = row_operand(rng, rows, 384, gs, go)
  w_gate, w_up = weight_operand(rng, len(SIZES), 256, 384), weight_operand(
      rng, len(SIZES), 256, 384)
  from jax_ep.experts import fp8 as fp8_module
  from jax_ep.experts.layout import aligned_blocks
  src, count, first, blocks = aligned_blocks(gs, go, rows, 128)
  columns = lambda q, s: fp8_module.quantize_columns(q, s, src, count)  # noqa: E731
  runs = {
      "matmul": lambda: hopper_fp8.fp8_grouped_matmul_kernel(x, xs, *w_gate, gs, go,
                                                             tiles=tiles),
      "gated": lambda: hopper_fp8.fp8_gated_kernel(
          x, xs, w_gate[0], w_up[0], w_gate[1], w_up[1], gs, go, activation="swiglu",
          tiles=tiles),
      "weight_grad": lambda: hopper_fp8_wgrad.fp8_weight_grad_kernel(
          *columns(x, xs), *columns(x, xs), first, blocks, tiles=tiles)}
  for what, run in runs.items():
    with plgpu.force_gpu_interpret_mode(params.InterpretGPUParams(detect_races=True)), \
        experts.override(kernel_sms=2):
      jax.block_until_ready(run())
    assert not interpret_pallas_call.get_races().races_found, f"{what}: a race"


def test_matmul_float32_out_and_contiguous_groups():
  rng = np.random.default_rng(1)
  sizes = jnp.asarray([70, 0, 100], jnp.int32)
  rows = 200  # 30 rows past the groups, a row count no tile divides
  offsets = jnp.asarray([0, 70, 70], jnp.int32)
  x, xs = row_operand(rng, rows, 384, sizes, offsets)
  w, ws = weight_operand(rng, 3, 128, 384)
  with interpret():
    got = hopper_fp8.fp8_grouped_matmul_kernel(x, xs, w, ws, sizes, tiles=PLAIN,
                                               out_dtype=jnp.float32)
  assert got.dtype == jnp.float32
  want, absolute = oracle([(x, xs)], [(w, ws)], sizes, offsets)
  inside = np.asarray(rows_inside_groups(sizes, offsets, rows))
  # No rounding to bf16: the fp32 arithmetic alone.
  err = np.abs(np.asarray(got, np.float64)[inside] - want[inside])
  assert (err <= 2.0 ** -20 * np.abs(want[inside]) + ABS_INTERPRETED * absolute[inside]).all()


@BOTH
def test_rows_outside_the_groups_never_reach_a_stored_row(tiles):
  """NaN or zeros outside the groups (rows and scales): the stored rows are the same bits."""
  gs, go, rows = layout(SIZES)
  w, ws = weight_operand(np.random.default_rng(2), len(SIZES), 128, 256)
  outs = []
  for fill in (np.nan, 0.0):
    x, xs = row_operand(np.random.default_rng(3), rows, 256, gs, go, fill=fill)
    with interpret():
      outs.append(np.asarray(hopper_fp8.fp8_grouped_matmul_kernel(
          x, xs, w, ws, gs, go, tiles=tiles), np.float32))
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  assert np.isfinite(outs[0][inside]).all()
  np.testing.assert_array_equal(outs[0][inside], outs[1][inside])


def check_gated(outs, x, xs, w_gate, w_up, gs, go, activation, abs_bound, oracle=oracle):
  h, h_scales, gate, up = outs
  rows, f = h.shape
  assert h.dtype == jnp.float8_e4m3fn and h_scales.dtype == jnp.float32
  assert h_scales.shape == (rows, f // 128) and gate.dtype == jnp.bfloat16
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  want_gate, abs_gate = oracle([(x, xs)], [w_gate], gs, go)
  assert_within(gate, want_gate, abs_gate, inside, "gate", abs_bound)
  # What the kernel's h may differ from the oracle's by before it is rounded: h = act(gate) *
  # up is taken from the fp32 totals (not the bf16 outputs), each within the arithmetic's
  # bound, and carries their errors (|act'| <= _ACT_SLOPE) and its own fp32 rounding.
  d_gate = (2.0 ** -20 * np.abs(want_gate) + abs_bound * abs_gate)[inside]
  want_h = np.asarray(mlp.act(jnp.asarray(want_gate), activation), np.float64)
  if w_up is not None:
    want_up, abs_up = oracle([(x, xs)], [w_up], gs, go)
    assert_within(up, want_up, abs_up, inside, "up", abs_bound)
    d_up = (2.0 ** -20 * np.abs(want_up) + abs_bound * abs_up)[inside]
    slack = (_ACT_SLOPE * d_gate * (np.abs(want_up[inside]) + d_up)
             + np.abs(want_h[inside]) * d_up)
    want_h = want_h * want_up
  else:
    assert up is None
    slack = _ACT_SLOPE * d_gate
  slack = slack + 2.0 ** -20 * np.abs(want_h[inside])  # the activation's own fp32 rounding
  want_q, want_s = fp8_quantize(jnp.asarray(want_h[inside], jnp.float32))
  want_q, want_s = np.asarray(want_q, np.float64), np.asarray(want_s, np.float64)
  got_q = np.asarray(h, np.float64)[inside]
  got_s = np.asarray(h_scales, np.float64)[inside]
  assert np.isfinite(got_q).all() and np.isfinite(got_s).all()
  # The scales: amax / 448 of the kernel's h against the oracle's, which the slack may move.
  block_slack = slack.reshape(*slack.shape[:-1], -1, 128).max(axis=-1)
  np.testing.assert_array_less(np.abs(got_s - want_s),
                               2 ** -10 * want_s + block_slack / 448 + 1e-30)
  # h: within one e4m3 step (at the row block's scale) of a value within `slack` of the
  # oracle's h.
  scale = np.repeat(got_s, 128, axis=1)
  wanted = want_h[inside]
  err = np.abs(got_q * scale - wanted)
  step = e4m3_step((np.abs(wanted) + slack) / scale) * scale
  bound = step * (1 + 2 ** -10) + slack
  bad = err > bound
  w = np.argmax(err - bound)
  assert not bad.any(), (
      f"h: {bad.sum()} of {bad.size} codes more than one e4m3 step from the oracle's h (with "
      f"the fp32 totals' slack); the worst at (row, column) "
      f"{tuple(int(i) for i in np.unravel_index(w, err.shape))}: got {got_q.flat[w]} x "
      f"{scale.flat[w]:.6g}, want {wanted.flat[w]:.6g}, slack {slack.flat[w]:.3g}; by column "
      f"mod 128 {np.bincount(np.nonzero(bad)[1] % 128, minlength=128).tolist()}")
  # The codes: `fp8_quantize`'s of the oracle's h but where a value sits at a rounding
  # boundary within the arithmetic's error: among the codes whose slack is under a tenth of a
  # step, at most 1% plus what the slack explains (a code within `slack` of a boundary flips:
  # at most 2 * slack / step of them), each one step away. A wrong rounding rule (truncation)
  # flips about half.
  exact = slack <= 0.1 * step
  flips = (got_q != want_q) & exact
  allowed = 0.01 * exact.sum() + 2 * np.sum((slack / step)[exact]) + 2
  assert flips.sum() <= allowed, (
      f"{flips.sum()} of h's {exact.sum()} codes with a slack under a tenth of a step differ "
      f"from the oracle's (at most {allowed:.1f})")
  assert (np.abs(got_q - want_q)[flips] <= e4m3_step(np.maximum(
      np.abs(got_q), np.abs(want_q)))[flips]).all()


def test_the_gated_check_allows_the_totals_error_and_finds_a_wrong_code():
  """`check_gated` on outputs made from the oracle's totals moved by up to half the GPU's
  bound (Hopper's FP8 products keep fewer bits than fp32 within each 128-deep block): they
  pass, h's codes included (one step of e4m3 is not enough slack where the totals' error
  moves h by more); two codes swapped in one row fail."""
  rng = np.random.default_rng(11)
  gs, go, rows = layout([300, 0, 200])
  x, xs = row_operand(rng, rows, 2048, gs, go)
  w_gate, w_up = weight_operand(rng, 3, 256, 2048), weight_operand(rng, 3, 256, 2048)
  moved = []
  for w in (w_gate, w_up):
    want, absolute = oracle([(x, xs)], [w], gs, go)
    moved.append(want + ABS_HOPPER * absolute * rng.uniform(-0.5, 0.5, want.shape))
  h = np.asarray(mlp.act(jnp.asarray(moved[0], jnp.float32), "swiglu"), np.float64) * moved[1]
  q, scales = fp8_quantize(jnp.asarray(h, jnp.float32))
  gate, up = (jnp.asarray(m, jnp.bfloat16) for m in moved)
  check_gated((q, scales, gate, up), x, xs, w_gate, w_up, gs, go, "swiglu", ABS_HOPPER)
  swapped = np.asarray(q).copy()
  row = int(go[0]) + 5
  columns = [3, 40] if swapped[row, 3] != swapped[row, 40] else [3, 41]
  swapped[row, columns] = swapped[row, columns[::-1]]
  with pytest.raises(AssertionError, match="codes more than one e4m3 step"):
    check_gated((jnp.asarray(swapped), scales, gate, up), x, xs, w_gate, w_up, gs, go,
                "swiglu", ABS_HOPPER)


@BOTH
@pytest.mark.parametrize("activation", hopper_fp8.ACTIVATIONS)
def test_gated_kernel_matches_the_oracle(activation, tiles):
  rng = np.random.default_rng(4)
  gs, go, rows = layout(SIZES)
  x, xs = row_operand(rng, rows, 256, gs, go)
  w_gate = weight_operand(rng, len(SIZES), 256, 256)
  w_up = weight_operand(rng, len(SIZES), 256, 256) if activation in mlp.GATED else None
  with interpret():
    outs = hopper_fp8.fp8_gated_kernel(
        x, xs, w_gate[0], None if w_up is None else w_up[0], w_gate[1],
        None if w_up is None else w_up[1], gs, go, activation=activation, tiles=tiles)
  check_gated(outs, x, xs, w_gate, w_up, gs, go, activation, ABS_INTERPRETED)


@BOTH
def test_gated_kernel_ignores_rows_outside_the_groups(tiles):
  gs, go, rows = layout(SIZES)
  rng = np.random.default_rng(5)
  w_gate, w_up = weight_operand(rng, len(SIZES), 256, 256), weight_operand(
      rng, len(SIZES), 256, 256)
  outs = []
  for fill in (np.nan, 0.0):
    x, xs = row_operand(np.random.default_rng(6), rows, 256, gs, go, fill=fill)
    with interpret():
      outs.append([np.asarray(o, np.float32) for o in hopper_fp8.fp8_gated_kernel(
          x, xs, w_gate[0], w_up[0], w_gate[1], w_up[1], gs, go, activation="swiglu",
          tiles=tiles)])
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  for a, b in zip(*outs):
    assert np.isfinite(a[inside]).all()
    np.testing.assert_array_equal(a[inside], b[inside])


@pytest.mark.parametrize("gated", [True, False])
def test_the_mlps_input_grad_is_one_product_over_both_projections(monkeypatch, gated):
  """The FP8 MLP's `dx = dgate @ w_gate^T + dup @ w_up^T`: its cotangents quantised per row
  (`fp8_quantize`), both weights' transposed blocks side by side, one FP8 kernel over the
  reduction of 2F (interpreted) against the float64 sum of the two products."""
  from jax_ep.experts import choice, fp8, mlp_fp8, quantize_kernel
  monkeypatch.setattr(choice, "on_hopper", lambda: True)
  monkeypatch.setattr(fp8, "fp8_compile_error", lambda *args: None)
  monkeypatch.setattr(quantize_kernel, "quantize_weight_blocks", functools.partial(
      quantize_kernel.quantize_weight_blocks, interpret=True))
  rng = np.random.default_rng(7)
  gs, go, rows = layout(SIZES)
  hidden, ffn = 128, 256
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  d = [jnp.asarray(np.where(inside[:, None], rng.standard_normal((rows, ffn)), np.nan),
                   jnp.float32) for _ in range(2 if gated else 1)]
  masters = [jnp.asarray(rng.standard_normal((len(SIZES), hidden, ffn)) * hidden ** -0.5,
                         jnp.float32) for _ in d]  # [G, H, F]: w_gate, w_up
  weights = [fp8.quantize_weights(m) for m in masters]
  kernels = []
  real = hopper_fp8.fp8_grouped_matmul_kernel
  monkeypatch.setattr(hopper_fp8, "fp8_grouped_matmul_kernel",
                      lambda *a, **k: kernels.append(a[0].shape) or real(*a, **k))
  with interpret():
    got = jax.jit(lambda *a: mlp_fp8._input_grad(a[:len(d)], weights, *a[len(d):]))(
        *d, gs, go)
  assert kernels == [(rows, ffn * len(d))], kernels
  assert got.shape == (rows, hidden) and got.dtype == jnp.bfloat16
  quantised = [fp8_quantize(a) for a in d]
  transposed = [w.transposed() for w in weights]
  want, absolute = oracle(quantised, [(t.values, t.scales) for t in transposed], gs, go)
  assert_within(got, want, absolute, inside, "dx")


def test_the_epilogues_activation_is_the_bf16_kernels():
  g = jnp.linspace(-12.0, 12.0, 1001, dtype=jnp.float32)
  for activation in hopper_fp8.ACTIVATIONS:
    np.testing.assert_array_equal(hopper_fp8.activation_fn(g, activation),
                                  mlp.act(g, activation))


def test_the_epilogues_quantisation_is_fp8_quantize():
  h = jnp.asarray(np.random.default_rng(8).standard_normal((64, 128)) * np.exp2(
      np.arange(-32, 32))[:, None], jnp.float32).at[3].set(0.0)
  q, s = hopper_fp8.quantize_rows(h)
  want_q, want_s = fp8_quantize(h)
  np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s)[:, 0])
  np.testing.assert_array_equal(np.asarray(q, np.float32), np.asarray(want_q, np.float32))


# ------------------------------------------------------------------ the weight gradient

def column_case(rng, sizes, alignment, channels, dtype, fill=np.nan, nan_inside=True):
  """Rows `[rows, channels]` of `dtype` (e4m3: with their row scales) over 16 binades, `fill`
  in every row outside the groups (`nan_inside`: and the first group's row 3 NaN in three
  channels); the layout and the group-aligned copy's blocks (`layout.aligned_blocks`)."""
  from jax_ep.experts.layout import aligned_blocks
  gs, go, rows = layout(sizes, alignment)
  rows += 5  # rows past the last group
  x = rng.standard_normal((rows, channels)) * np.exp2(rng.uniform(-8, 8, (rows, 1)))
  if nan_inside:
    x[int(go[0]) + 3, :3] = np.nan
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  x[~inside] = fill
  blocks = aligned_blocks(gs, go, rows, 128)
  if dtype == jnp.float8_e4m3fn:
    q, scales = fp8_quantize(jnp.asarray(x, jnp.float32))
    return (q, scales), gs, go, blocks
  return (jnp.asarray(x, dtype), None), gs, go, blocks


def written_blocks(count):
  """The blocks of the copy that the column kernel writes: those holding rows, and the last
  (the empty groups' zeros)."""
  count = np.asarray(count)
  return np.flatnonzero((count > 0) | (np.arange(len(count)) == len(count) - 1))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn],
                         ids=["bf16", "f32", "e4m3"])
def test_the_column_quantisation_kernel_is_xlas(dtype):
  """The weight gradients' quantisation per 128 tokens per channel (interpreted) against XLA's
  (`fp8.quantize_columns`), both jitted: each written block's values and scales bit for bit,
  e4m3 rows dequantised first; a NaN stays in its element and out of its block's scale; the
  copy's rows past a group, and its last block, zeros; rows outside the groups (NaN) never
  reach it."""
  from jax_ep.experts import fp8 as fp8_module
  from jax_ep.experts.quantize_kernel import quantize_column_blocks
  (x, xs), gs, go, (src, count, first, blocks) = column_case(
      np.random.default_rng(3), [150, 0, 37, 256, 1], 1, 256, dtype)
  got = jax.jit(lambda *a: quantize_column_blocks(*a, interpret=True))(x, xs, src, count)
  want = jax.jit(fp8_module.quantize_columns)(x, xs, src, count)
  num_blocks = src.shape[0]
  assert got[0].shape == (256, num_blocks * 128) and got[1].shape == (num_blocks, 256)
  assert got[0].dtype == jnp.float8_e4m3fn and got[1].dtype == jnp.float32
  for b in written_blocks(count):
    cols = slice(128 * b, 128 * (b + 1))
    np.testing.assert_array_equal(np.asarray(got[0][:, cols]).view(np.uint8),
                                  np.asarray(want[0][:, cols]).view(np.uint8), err_msg=str(b))
    np.testing.assert_array_equal(np.asarray(got[1][b]), np.asarray(want[1][b]))
  q = np.asarray(got[0], np.float32)
  scales = np.asarray(got[1])
  assert np.isfinite(scales[written_blocks(count)]).all()
  # Row 3 of the first group (the copy's row 3 of block 0) holds the NaNs.
  assert np.isnan(q[:3, 3]).all() and np.isfinite(q[3:, 3]).all()
  last = num_blocks - 1
  assert (q[:, 128 * last:] == 0).all()
  # The first group's last block holds 150 - 128 = 22 rows: the rest of it zeros.
  assert (q[:, 128 + 22:256] == 0).all() and (q[:, 128:128 + 22] != 0).any()


def weight_grad_oracle(a, b, first, blocks):
  """`(out, absolute)` `[G, P, Q]` in float64: each group's blocks of the dequantised copies
  `(q, scales)`, `a^T`'s and `b^T`'s product (and of their absolute values)."""
  def dequantize(q, scales):
    return np.asarray(q, np.float64) * np.repeat(np.asarray(scales, np.float64).T, 128, axis=1)
  a, b = dequantize(*a), dequantize(*b)
  outs, absolute = [], []
  for f, n in zip(np.asarray(first), np.asarray(blocks)):
    cols = slice(128 * int(f), 128 * int(f + n))
    outs.append(a[:, cols] @ b[:, cols].T)
    absolute.append(np.abs(a[:, cols]) @ np.abs(b[:, cols]).T)
  return np.stack(outs), np.stack(absolute)


def weight_grad_case(seed, alignment):
  """The FP8 weight gradient's operands as the MLP gives them, over groups with gaps (at
  `alignment`), an empty one and one of a single row, NaN in every row outside the groups:
  `[dgate | dup]`'s copy (bf16 rows, 256 channels), `x`'s (e4m3 rows, 128), each group's
  blocks."""
  from jax_ep.experts import fp8 as fp8_module
  rng = np.random.default_rng(seed)
  sizes = [150, 0, 37, 256, 1]
  (x, xs), gs, go, (src, count, first, blocks) = column_case(
      rng, sizes, alignment, 128, jnp.float8_e4m3fn, nan_inside=False)
  (d, _), *_ = column_case(rng, sizes, alignment, 256, jnp.bfloat16, nan_inside=False)
  return (fp8_module.quantize_columns(d, None, src, count),
          fp8_module.quantize_columns(x, xs, src, count), first, blocks)


@BOTH
def test_weight_grad_matches_the_dequantised_oracle(tiles):
  """The FP8 weight gradient (interpreted) of the copies the MLP gives it (`weight_grad_case`),
  `x`'s against `[dgate | dup]`'s (two parts, one result each); few CTAs, many items each."""
  d_t, x_t, first, blocks = weight_grad_case(4, 128)
  with interpret(), experts.override(kernel_sms=2):
    outs = hopper_fp8_wgrad.fp8_weight_grad_kernel(*x_t, *d_t, first, blocks, tiles=tiles, parts=2)
  assert len(outs) == 2 and all(o.shape == (5, 128, 128) and o.dtype == jnp.bfloat16
                                for o in outs)
  want, absolute = weight_grad_oracle(x_t, d_t, first, blocks)
  got = np.concatenate([np.asarray(o, np.float64) for o in outs], axis=2)
  assert np.isfinite(got).all()
  err = np.abs(got - want)
  assert (err <= REL * np.abs(want) + ABS_INTERPRETED * absolute).all(), err.max()
  assert (got[1] == 0).all()  # the empty group
  assert np.abs(got[0]).max() > 0 and np.abs(got[4]).max() > 0


def test_the_copy_starts_each_group_at_a_block():
  """`layout.aligned_blocks`: per block its source rows, per group its blocks; an empty group
  has the last block (all zeros), which no group's rows reach."""
  from jax_ep.experts.layout import aligned_blocks
  sizes = jnp.asarray([130, 0, 5, 128], jnp.int32)
  offsets = jnp.asarray([2, 132, 140, 150], jnp.int32)
  src, count, first, blocks = (np.asarray(a) for a in aligned_blocks(sizes, offsets, 300, 128))
  assert len(src) == 3 + 4 + 1
  np.testing.assert_array_equal(count[:5], [128, 2, 5, 128, 0])
  np.testing.assert_array_equal(src[:4], [2, 130, 140, 150])
  np.testing.assert_array_equal(first, [0, 7, 2, 3])
  np.testing.assert_array_equal(blocks, [2, 1, 1, 1])
  assert count[-1] == 0


# ------------------------------------------------------------------ bad input

def _abstract(rows=256, groups=2, k=256, n=256, x_dtype=jnp.float8_e4m3fn):
  S = jax.ShapeDtypeStruct
  return (S((rows, k), x_dtype), S((rows, k // 128), jnp.float32),
          S((groups, n, k), jnp.float8_e4m3fn), S((groups, n // 128, k // 128), jnp.float32),
          S((groups,), jnp.int32), S((groups,), jnp.int32))


@pytest.mark.parametrize("case,error,match", [
    (dict(x_dtype=jnp.bfloat16), TypeError, "x must be float8_e4m3fn"),
    (dict(k=192), ValueError, "multiples of 128"),
])
def test_bad_operands_are_named(case, error, match):
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda *a: hopper_fp8.fp8_grouped_matmul_kernel(*a, tiles=PLAIN),
                   *_abstract(**case))


@pytest.mark.parametrize("tiles,match", [
    (KernelTiles(64, 128, 64, 2, 1, 1), "block_k = 128"),
    (KernelTiles(64, 256, 128, 2, 1, 1), "dividing 128"),
    (KernelTiles(64, 128, 128, 2, 1, 2), "64 \\* compute_wgs"),
    (KernelTiles(128, 128, 128, 2, 1, 1), "registers"),
    (KernelTiles(128, 128, 128, 7, 1, 2), "shared memory"),
    # bf16 rows of 32 columns: 64 bytes, a TMA store from row 1 would be misaligned.
    (KernelTiles(64, 32, 128, 2, 1, 1), "multiple of 128 bytes"),
])
def test_tiles_that_cannot_run_are_named(tiles, match):
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda *a: hopper_fp8.fp8_grouped_matmul_kernel(*a, tiles=tiles),
                   *_abstract())


def test_bad_scales_and_activation_are_named():
  x, xs, w, ws, gs, go = _abstract()
  with pytest.raises(ValueError, match=r"w_scales must be float32 \(2, 2, 2\)"):
    jax.eval_shape(lambda *a: hopper_fp8.fp8_grouped_matmul_kernel(*a, tiles=PLAIN),
                   x, xs, w, jax.ShapeDtypeStruct((2, 2), jnp.float32), gs, go)
  with pytest.raises(ValueError, match="activation must be one of"):
    hopper_fp8.fp8_gated_kernel(x, xs, w, w, ws, ws, gs, go, activation="relu", tiles=PLAIN)
  with pytest.raises(ValueError, match="takes w_up and scales_up"):
    hopper_fp8.fp8_gated_kernel(x, xs, w, None, ws, None, gs, go, activation="swiglu",
                                tiles=PLAIN)


# ------------------------------------------------------------------ lowered for CUDA

def _lower(fn, *operands):
  jax.jit(fn).trace(*operands).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("product", ["up", "down"])
@pytest.mark.parametrize("groups,hidden,ffn", MODEL_SHAPES, ids=SHAPE_IDS)
def test_matmul_lowers_for_cuda_at_the_model_shapes(groups, hidden, ffn, product):
  k, n = (hidden, ffn) if product == "up" else (ffn, hidden)
  tiles = configs.fp8_tile_config(groups, k, n)
  assert tiles is not None
  _lower(lambda *a: hopper_fp8.fp8_grouped_matmul_kernel(*a, tiles=tiles),
         *_abstract(4096, groups, k, n))


def test_one_warpgroup_kernels_lower_for_cuda():
  one = configs.FP8_ONE_WARPGROUP
  assert one.compute_wgs == 1
  _lower(lambda *a: hopper_fp8.fp8_grouped_matmul_kernel(*a, tiles=one),
         *_abstract(4096, 32, 2048, 7168))
  x, xs, w, ws, gs, go = _abstract(4096, 32, 7168, 2048)
  _lower(lambda x, xs, w, ws, gs, go: hopper_fp8.fp8_gated_kernel(
      x, xs, w, w, ws, ws, gs, go, activation="geglu", tiles=one), x, xs, w, ws, gs, go)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("groups,hidden,ffn", MODEL_SHAPES, ids=SHAPE_IDS)
def test_gated_kernel_lowers_for_cuda_at_the_model_shapes(groups, hidden, ffn, activation):
  x, xs, w, ws, gs, go = _abstract(4096, groups, hidden, ffn)
  gated = activation in mlp.GATED
  tiles = configs.fp8_gated_tiles(hidden, ffn)
  _lower(lambda x, xs, w, ws, gs, go: hopper_fp8.fp8_gated_kernel(
      x, xs, w, w if gated else None, ws, ws if gated else None, gs, go,
      activation=activation, tiles=tiles), x, xs, w, ws, gs, go)


@pytest.mark.parametrize("groups,hidden,ffn", MODEL_SHAPES, ids=SHAPE_IDS)
def test_input_grad_lowers_for_cuda_at_the_model_shapes(groups, hidden, ffn):
  """The input gradient of both projections: the warp-specialized kernel over K = 2F."""
  tiles = configs.fp8_tile_config(groups, 2 * ffn, hidden)
  assert tiles.compute_wgs == 2
  _lower(lambda *a: hopper_fp8.fp8_grouped_matmul_kernel(*a, tiles=tiles),
         *_abstract(4096, groups, 2 * ffn, hidden))


@pytest.mark.parametrize("product", ["gate_up", "down"])
@pytest.mark.parametrize("groups,hidden,ffn", MODEL_SHAPES, ids=SHAPE_IDS)
def test_weight_grad_lowers_for_cuda_at_the_model_shapes(groups, hidden, ffn, product):
  """The FP8 weight gradients as the MLP runs them: `x^T [dgate | dup]` (P = H, Q = 2F in two
  parts) and `h^T dy` (P = F, Q = H), over 4096 tokens' copy."""
  p, q, parts = (hidden, 2 * ffn, 2) if product == "gate_up" else (ffn, hidden, 1)
  tiles = configs.fp8_weight_grad_tiles(p, q)
  blocks = 4096 // 128 + groups + 1
  S = jax.ShapeDtypeStruct
  e4m3 = jnp.float8_e4m3fn
  _lower(lambda *a: hopper_fp8_wgrad.fp8_weight_grad_kernel(*a, tiles=tiles, parts=parts),
         S((p, blocks * 128), e4m3), S((blocks, p), jnp.float32), S((q, blocks * 128), e4m3),
         S((blocks, q), jnp.float32), S((groups,), jnp.int32), S((groups,), jnp.int32))


# ------------------------------------------------------------------ the benchmark

@pytest.mark.slow
def test_the_benchmark_writes_grouped_matmul_records(tmp_path):
  """benchmarks/bench_fp8_gemm.py on the CPU, the FP8 kernel interpreted: the records' fields
  (the timings mean nothing here)."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "fp8.jsonl"
  result = subprocess.run(
      [sys.executable, os.path.join(root, "benchmarks", "bench_fp8_gemm.py"), "--shapes",
       "qwen3_30b_a3b", "--products", "up", "gate_up", "input_grad", "weight_grad", "--scale",
       "16", "--tokens",
       "16", "--interpret",
       "--repeats", "0", "--out", str(out)],
      env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert sorted((r["product"], r["precision"]) for r in records) == [
      ("gate_up", "bf16"), ("gate_up", "fp8"), ("input_grad", "bf16"), ("input_grad", "fp8"),
      ("up", "bf16"), ("up", "fp8"), ("weight_grad", "bf16"), ("weight_grad", "fp8"),
      ("weight_grad", "fp8")]
  assert {str(r["settings"]) for r in records if r["product"] == "weight_grad"} == {
      "default", "{'without': 'column quantisation'}"}
  for r in records:
    assert r["op"] == "grouped_matmul" and r["pass"] == "fwd"
    assert (r["experts"], r["k"], r["n"], r["rows"]) == (8, 128, 128, 16 * 8)
    assert r["bound"] == "dense_gemm" and r["median_us"] > 0
    assert {"tflops", "bound_tflops", "fraction", "gpu", "jax", "date", "commit"} <= set(r)
  for fp8 in (r for r in records if r["precision"] == "fp8"):
    assert fp8["impl"] == "mosaic_fp8" and fp8["dtype"] == "float8_e4m3fn"
    assert {"speedup_vs_bf16", "dense_fp8_tflops"} <= set(fp8)


# ------------------------------------------------------------------ on Hopper

def skewed_sizes(rng, groups, total):
  """`groups` sizes summing to about `total`, Zipf-skewed, the last group empty."""
  weights = 1.0 / np.arange(1, groups + 1) ** 1.2
  rng.shuffle(weights)
  weights[-1] = 0.0
  return np.floor(weights / weights.sum() * total).astype(np.int32)


def gpu_case(seed, groups, tokens=4096):
  """A generator and a skewed layout of `tokens` rows over `groups` experts, each group at a
  multiple of 128 (rows: the groups and their padding)."""
  rng = np.random.default_rng(seed)
  gs, go, rows = layout(skewed_sizes(rng, groups, tokens))
  return rng, gs, go, rows


@pytest.mark.gpu
@pytest.mark.parametrize("product", ["up", "down"])
@pytest.mark.parametrize("groups,hidden,ffn", MODEL_SHAPES, ids=SHAPE_IDS)
def test_matmul_on_hopper(groups, hidden, ffn, product):
  require_hopper()
  k, n = (hidden, ffn) if product == "up" else (ffn, hidden)
  rng, gs, go, rows = gpu_case(10, groups)
  x, xs = row_operand(rng, rows, k, gs, go)
  w, ws = weight_operand(rng, groups, n, k)
  tiles = configs.fp8_tile_config(groups, k, n)
  got = jax.jit(lambda *a: hopper_fp8.fp8_grouped_matmul_kernel(*a, tiles=tiles))(
      x, xs, w, ws, gs, go)
  want, absolute = oracle_on_device([(x, xs)], [(w, ws)], gs, go)
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  assert_within(got, want, absolute, inside, f"fp8 matmul {product}", ABS_HOPPER)


@pytest.mark.gpu
@pytest.mark.parametrize("groups,hidden,ffn", MODEL_SHAPES, ids=SHAPE_IDS)
def test_gated_kernel_on_hopper(groups, hidden, ffn):
  require_hopper()
  rng, gs, go, rows = gpu_case(11, groups)
  x, xs = row_operand(rng, rows, hidden, gs, go)
  w_gate, w_up = weight_operand(rng, groups, ffn, hidden), weight_operand(
      rng, groups, ffn, hidden)
  tiles = configs.fp8_gated_tiles(hidden, ffn)
  outs = jax.jit(lambda *a: hopper_fp8.fp8_gated_kernel(
      *a, activation="swiglu", tiles=tiles))(x, xs, w_gate[0], w_up[0], w_gate[1], w_up[1],
                                             gs, go)
  check_gated(outs, x, xs, w_gate, w_up, gs, go, "swiglu", ABS_HOPPER, oracle_on_device)


@pytest.mark.gpu
@pytest.mark.parametrize("groups,hidden,ffn", MODEL_SHAPES, ids=SHAPE_IDS)
def test_input_grad_on_hopper(groups, hidden, ffn):
  """The MLP's input gradient of both projections as it runs: `[dgate | dup]` by `[w_gate |
  w_up]` side by side along F, one product of K = 2F, against both products' oracle."""
  require_hopper()
  rng, gs, go, rows = gpu_case(12, groups)
  dgate, dup = row_operand(rng, rows, ffn, gs, go), row_operand(rng, rows, ffn, gs, go)
  w_gate, w_up = weight_operand(rng, groups, hidden, ffn), weight_operand(
      rng, groups, hidden, ffn)
  tiles = configs.fp8_tile_config(groups, 2 * ffn, hidden)
  side = lambda a, b, axis: jnp.concatenate([a, b], axis=axis)  # noqa: E731
  got = jax.jit(lambda *a: hopper_fp8.fp8_grouped_matmul_kernel(*a, tiles=tiles))(
      side(dgate[0], dup[0], 1), side(dgate[1], dup[1], 1), side(w_gate[0], w_up[0], 2),
      side(w_gate[1], w_up[1], 2), gs, go)
  want, absolute = oracle_on_device([dgate, dup], [w_gate, w_up], gs, go)
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  assert_within(got, want, absolute, inside, "fp8 dx", ABS_HOPPER)


@pytest.mark.gpu
def test_gated_kernel_rounds_h_to_nearest_on_hopper():
  """Operands whose totals the tensor cores hold exactly (codes -1, 0 and 1 at scale 1: each
  128-deep block's sum and the fp32 total are integers far below 2^13), at DeepSeek-V3's EP=8
  rank shape: with no slack from the arithmetic but the activation's fp32 rounding, h's codes
  are `fp8_quantize`'s (round to nearest even), which the random operands' slack hides."""
  require_hopper()
  groups, hidden, ffn = 32, 7168, 2048
  rng, gs, go, rows = gpu_case(14, groups)
  keys = jax.random.split(jax.random.key(14), 3)
  inside = rows_inside_groups(gs, go, rows)[:, None]
  codes = lambda key, shape: jax.random.randint(key, shape, -1, 2).astype(  # noqa: E731
      jnp.float8_e4m3fn)
  x = jnp.where(inside, codes(keys[0], (rows, hidden)), jnp.asarray(jnp.nan, jnp.float8_e4m3fn))
  xs = jnp.ones((rows, hidden // 128), jnp.float32)
  w_gate, w_up = ((codes(k, (groups, ffn, hidden)),
                   jnp.ones((groups, ffn // 128, hidden // 128), jnp.float32))
                  for k in keys[1:])
  tiles = configs.fp8_gated_tiles(hidden, ffn)
  outs = jax.jit(lambda *a: hopper_fp8.fp8_gated_kernel(
      *a, activation="swiglu", tiles=tiles))(x, xs, w_gate[0], w_up[0], w_gate[1], w_up[1],
                                             gs, go)
  check_gated(outs, x, xs, w_gate, w_up, gs, go, "swiglu", 0.0, oracle_on_device)


@pytest.mark.gpu
def test_one_warpgroup_forms_and_a_plain_activation_on_hopper():
  """The one-warpgroup matmul and gated kernel (the tiles `--tune` compares) and the gated
  kernel without `w_up` ("gelu"), at one model shape."""
  require_hopper()
  groups, hidden, ffn = 32, 4096, 1536
  one = configs.FP8_ONE_WARPGROUP
  rng, gs, go, rows = gpu_case(13, groups)
  x, xs = row_operand(rng, rows, hidden, gs, go)
  w_gate, w_up = weight_operand(rng, groups, ffn, hidden), weight_operand(
      rng, groups, ffn, hidden)
  inside = np.asarray(rows_inside_groups(gs, go, rows))
  got = jax.jit(lambda *a: hopper_fp8.fp8_grouped_matmul_kernel(*a, tiles=one))(
      x, xs, *w_gate, gs, go)
  want, absolute = oracle_on_device([(x, xs)], [w_gate], gs, go)
  assert_within(got, want, absolute, inside, "fp8 matmul, one warpgroup", ABS_HOPPER)
  outs = jax.jit(lambda *a: hopper_fp8.fp8_gated_kernel(*a, activation="geglu", tiles=one))(
      x, xs, w_gate[0], w_up[0], w_gate[1], w_up[1], gs, go)
  check_gated(outs, x, xs, w_gate, w_up, gs, go, "geglu", ABS_HOPPER, oracle_on_device)
  tiles = configs.fp8_gated_tiles(hidden, ffn)
  outs = jax.jit(lambda x, xs, w, s, gs, go: hopper_fp8.fp8_gated_kernel(
      x, xs, w, None, s, None, gs, go, activation="gelu", tiles=tiles))(
          x, xs, *w_gate, gs, go)
  check_gated(outs, x, xs, w_gate, None, gs, go, "gelu", ABS_HOPPER, oracle_on_device)


def weight_grad_errors_on_device(outs, a, b, first, blocks, abs_bound):
  """`(values off the bound, the worst)` of the FP8 weight gradient's parts `outs` (each `[G,
  P, Q / parts]`) against the float32 (HIGHEST) oracle of the dequantised copies `a`, `b`
  (`(q, scales)`), on the device: one block's product at a time in a scan over the groups'
  blocks, each group compared when its last block is in (the `[G, P, Q]` oracle of the model
  shapes would take tens of GB). The worst: `{group, p, q, got, want, absolute, excess}` of
  the value furthest past its bound; the largest `|got - want|` of any value relative to
  `absolute` and to the sum over 32-deep steps of the steps' largest `|a|` times largest `|b|`
  (an MMA that aligns a step's products to its largest loses bits in proportion to it); how
  many values miss 4, 16 and 64 times `abs_bound`. An empty group's result must be zeros."""
  first, blocks = np.asarray(first), np.asarray(blocks)
  # An empty group has the copy's last block (zeros), which no group's rows reach.
  empty = [g for g, f in enumerate(first) if f == a[1].shape[0] - 1]
  used = [(g, int(f) + i) for g, (f, n) in enumerate(zip(first, blocks)) if g not in empty
          for i in range(int(n))]
  order = np.asarray([b_ for _, b_ in used], np.int32)
  group_of = np.asarray([g for g, _ in used], np.int32)
  last = np.asarray([i == len(used) - 1 or used[i + 1][0] != g
                     for i, (g, _) in enumerate(used)])

  @jax.jit
  def errors(outs, a_q, a_s, b_q, b_s, order, group_of, last):
    def blocks_of(q, s):  # [blocks used, channels, 128] float32
      channels = q.shape[0]
      d = q.astype(jnp.float32).reshape(channels, -1, 128) * s.T[:, :, None]
      return jnp.moveaxis(d, 1, 0)[order]
    dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
    a_b, b_b = blocks_of(a_q, a_s), blocks_of(b_q, b_s)
    zeros = jnp.zeros((a_b.shape[1], b_b.shape[1]), jnp.float32)

    def chunk_max(x):  # [channels, 128] -> [channels, 4]: each 32-deep MMA step's largest
      return jnp.abs(x).reshape(x.shape[0], -1, 32).max(axis=2)

    def step(carry, xs):
      acc, acc_abs, acc_max, bad, worst, ratio, spread = carry
      ab, bb, g, is_last = xs
      acc, acc_abs = acc + dot(ab, bb.T), acc_abs + dot(jnp.abs(ab), jnp.abs(bb).T)
      acc_max = acc_max + dot(chunk_max(ab), chunk_max(bb).T)

      def compare(args):
        acc, acc_abs, acc_max, bad, worst, ratio, spread = args
        got = jnp.concatenate([o[g] for o in outs], axis=1).astype(jnp.float32)
        excess = jnp.abs(got - acc) - (REL * jnp.abs(acc) + abs_bound * acc_abs)
        excess = jnp.where(jnp.isnan(excess), jnp.inf, excess)  # NaN counts
        at = jnp.argmax(excess)
        p, q = at // excess.shape[1], at % excess.shape[1]
        here = jnp.stack([g.astype(jnp.float32), p.astype(jnp.float32), q.astype(jnp.float32),
                          got[p, q], acc[p, q], acc_abs[p, q], excess[p, q]])
        err = jnp.where(jnp.isnan(got), jnp.inf, jnp.abs(got - acc))
        rel = jnp.stack([jnp.max(err / jnp.maximum(acc_abs, 1e-30)),
                         jnp.max(err / jnp.maximum(acc_max, 1e-30))])
        # How far past the bound the misses lie: values off at 4, 16, 64 times abs_bound.
        off = jnp.stack([jnp.sum(err > REL * jnp.abs(acc) + m * abs_bound * acc_abs,
                                 dtype=jnp.int32) for m in (4, 16, 64)])
        return (zeros, zeros, zeros, bad + jnp.sum(excess > 0, dtype=jnp.int32),
                jnp.where(here[-1] > worst[-1], here, worst), jnp.maximum(ratio, rel),
                spread + off)
      return jax.lax.cond(is_last, compare, lambda c: c,
                          (acc, acc_abs, acc_max, bad, worst, ratio, spread)), None

    start = (zeros, zeros, zeros, jnp.int32(0), jnp.full((7,), -jnp.inf, jnp.float32),
             jnp.zeros((2,), jnp.float32), jnp.zeros((3,), jnp.int32))
    (*_, bad, worst, ratio, spread), _ = jax.lax.scan(
        step, start, (a_b, b_b, group_of, last))
    return bad, worst, ratio, spread

  bad, worst, ratio, spread = errors(tuple(outs), *a, *b, order, group_of, last)
  for g in empty:
    assert all(not np.asarray(jnp.any(o[g] != 0)) for o in outs), f"empty group {g}"
  worst = dict(zip(("group", "p", "q", "got", "want", "absolute", "excess"),
                   np.asarray(worst).tolist()))
  worst["largest_relative_to_absolute"] = float(ratio[0])
  worst["largest_relative_to_chunk_maxima"] = float(ratio[1])
  worst["off_at_4_16_64_times"] = np.asarray(spread).tolist()
  return int(bad), worst


def test_the_device_weight_grad_check_matches_the_float64_one():
  """The GPU tests' check (on the device, float32) passes the kernel's interpreted result and
  finds a value moved by 1 %."""
  d_t, x_t, first, blocks = weight_grad_case(8, 1)
  with interpret():
    outs = hopper_fp8_wgrad.fp8_weight_grad_kernel(*x_t, *d_t, first, blocks, tiles=SPECIALIZED,
                                             parts=2)
  assert weight_grad_errors_on_device(outs, x_t, d_t, first, blocks, ABS_INTERPRETED)[0] == 0
  moved = (outs[0], outs[1].at[3, 5, 7].multiply(1.01))
  assert weight_grad_errors_on_device(moved, x_t, d_t, first, blocks, ABS_INTERPRETED)[0] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_the_column_quantisation_kernel_on_hopper(dtype):
  """The weight gradients' copy of one rank of DeepSeek-V3 at EP=8's rows (32768 x 7168, 32
  skewed groups at no alignment: most start inside a block) against XLA's on the same GPU:
  the scales bit for bit, each value the same or one e4m3 step away (XLA's reciprocal may
  round apart at a boundary), the rows past each group zeros."""
  from jax_ep.experts import fp8 as fp8_module
  from jax_ep.experts.layout import aligned_blocks
  from jax_ep.experts.quantize_kernel import quantize_column_blocks
  from test_fp8_experts import _assert_within_one_e4m3_step
  require_hopper()
  rng = np.random.default_rng(14)
  gs, go, rows = layout(skewed_sizes(rng, 32, 32768), 1)
  x, xs = row_operand(rng, rows, 7168, gs, go)
  if dtype == jnp.bfloat16:
    x, xs = (x.astype(jnp.float32) * jnp.repeat(xs, 128, axis=1)).astype(jnp.bfloat16), None
  src, count, first, blocks = aligned_blocks(gs, go, rows, 128)
  got = jax.jit(quantize_column_blocks)(x, xs, src, count)
  want = jax.jit(fp8_module.quantize_columns)(x, xs, src, count)
  written = written_blocks(count)
  cols = (written[:, None] * 128 + np.arange(128)[None, :]).reshape(-1)
  np.testing.assert_array_equal(np.asarray(got[1])[written], np.asarray(want[1])[written])
  _assert_within_one_e4m3_step(np.asarray(got[0])[:, cols], np.asarray(want[0])[:, cols])


@pytest.mark.gpu
@pytest.mark.parametrize("product", ["gate_up", "down"])
@pytest.mark.parametrize("groups,hidden,ffn", MODEL_SHAPES, ids=SHAPE_IDS)
def test_weight_grad_on_hopper(groups, hidden, ffn, product):
  """The FP8 weight gradients as the MLP runs them, on the column kernel's copies of 4096
  skewed rows at no alignment (NaN outside the groups): `x^T [dgate | dup]` (two parts) and
  `h^T dy`, each in its master's layout, against the oracle of the same copies."""
  from jax_ep.experts.layout import aligned_blocks
  from jax_ep.experts.quantize_kernel import quantize_column_blocks
  require_hopper()
  rng = np.random.default_rng(15)
  gs, go, rows = layout(skewed_sizes(rng, groups, 4096), 1)
  p, q, parts = (hidden, 2 * ffn, 2) if product == "gate_up" else (ffn, hidden, 1)
  x, xs = row_operand(rng, rows, p, gs, go)
  d, _ = row_operand(rng, rows, q, gs, go)
  d = d.astype(jnp.bfloat16) * jnp.asarray(0.5, jnp.bfloat16)
  src, count, first, blocks = aligned_blocks(gs, go, rows, 128)
  columns = jax.jit(quantize_column_blocks)
  a, b = columns(x, xs, src, count), columns(d, None, src, count)
  tiles = configs.fp8_weight_grad_tiles(p, q)
  outs = jax.jit(lambda *args: hopper_fp8_wgrad.fp8_weight_grad_kernel(
      *args, tiles=tiles, parts=parts))(*a, *b, first, blocks)
  assert [o.shape for o in outs] == [(groups, p, q // parts)] * parts
  bad, worst = weight_grad_errors_on_device(outs, a, b, first, blocks, ABS_HOPPER_WGRAD)
  assert bad == 0, f"{bad} values off the bound, the worst by {worst}"
