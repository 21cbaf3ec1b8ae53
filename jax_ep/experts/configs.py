"""The expert kernels' tiles, keyed by architecture and dtype, and the one way to override them.

- `KernelTiles`: the Hopper grouped GEMM's (`jax_ep/experts/hopper.py`): a table of measured
  model shapes (`TILE_TABLES`), a rule for the rest (`tile_config`), the weight gradient's
  (`weight_grad_tiles`), and what to try where a choice does not build (`fallback_tiles`).
- `SlabTiles`: the decode experts' Triton kernels on the low-latency slabs
  (`jax_ep/experts/slab.py`), chosen by the slab's size (`SLAB_TILE_RULE`, `slab_tiles`).

`override(...)` replaces any of these choices (and what `impl='auto'` means) within a block:
benchmarks time other tiles and tests run small ones, without a module-level global to patch.
Nothing is tuned at call time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np


def target_devices() -> list:
  """The devices programs compile for: the default device where one is set
  (`jax.default_device`: a device, e.g. a compile-only H200 from `jax_ep.testing.aot`, or a
  platform's name), else every device."""
  default = jax.config.jax_default_device
  try:
    if default is None:
      return jax.devices()
    return jax.devices(default) if isinstance(default, str) else [default]
  except RuntimeError:
    return []


def on_hopper() -> bool:
  """Whether programs compile for Hopper GPUs (compute capability 9.0) alone: where the
  kernels run."""
  devices = target_devices()
  return bool(devices) and all(
      d.platform == "gpu" and getattr(d, "compute_capability", "") == "9.0" for d in devices)


# The row tile of jax_ep's grouped GEMM on Hopper: capacities derived from `buffer_factor`
# round up to it, so that the buffer is a whole number of tiles.
ROW_TILE = 128

HOPPER = "sm90"


@dataclasses.dataclass(frozen=True)
class KernelTiles:
  """Tiles of the Hopper grouped GEMM: the output tile is `block_m x block_n`, the reduction
  steps `block_k` deep, `stages` of them in flight; `band` output column tiles are walked
  together (a band of columns of one expert's weights stays in L2 while the row tiles pass).
  With `compute_wgs` 2 the forward kernel is warp-specialized: a memory warpgroup loads, two
  compute warpgroups each multiply `block_n` of the CTA's `2 * block_n` columns (the weight
  gradient's warp-specialized kernel: `block_m` of its `2 * block_m` rows). The kernels are
  persistent: `ctas_per_sm` CTAs per SM walk the output tiles (two fit an SM where one
  warpgroup's registers and its stages' shared memory are at most half of it: one CTA's loads
  and products then run in the other's pipeline fill and output store). `groups_per_run` (the
  one-warpgroup weight gradient): the reduction's pipeline of an output tile runs through the
  blocks of this many consecutive groups, storing each group's tile as it ends, so that the
  next group's loads run while one's tile is stored; 1: a pipeline per group and output
  tile."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  band: int = 4
  compute_wgs: int = 1
  ctas_per_sm: int = 1
  groups_per_run: int = 1


@dataclasses.dataclass(frozen=True)
class SlabTiles:
  """Tiles of the slab kernels: rows, columns and reduced dimension of one step, and Triton's
  warps and pipeline stages."""
  block_m: int
  block_n: int
  block_k: int
  num_warps: int
  num_stages: int


# Tiles for shapes `(groups, K, N)` measured on an H200 with `benchmarks/bench_layer.py
# --tune`, per (architecture, operand dtype); shapes not listed take `tile_config`'s rule.
_HOPPER_16BIT = {
    (256, 7168, 2048): KernelTiles(128, 128, 64, 3, 1, 2),  # DeepSeek-V3
    (128, 2048, 768): KernelTiles(128, 64, 64, 6, 1, 2),  # Qwen3-30B-A3B
    (32, 4096, 1536): KernelTiles(128, 64, 64, 6, 4, 2),
    (8, 4096, 14336): KernelTiles(128, 128, 64, 3, 1, 2),  # Mixtral 8x7B
}
TILE_TABLES: dict[tuple[str, np.dtype], dict[tuple[int, int, int], KernelTiles]] = {
    (HOPPER, np.dtype(jnp.bfloat16)): _HOPPER_16BIT,
    (HOPPER, np.dtype(jnp.float16)): _HOPPER_16BIT,
}

# The weight gradient's kernel with one compute warpgroup: warp-specialized (a memory warpgroup
# loads the next output tile's row blocks while the compute warpgroup stores the last), or one
# warpgroup. NOTES: the one-warpgroup kernel with 4 stages was as fast or faster at the four
# model shapes on an H200 (e.g. 561 vs 483 TF/s at Mixtral, 164 vs 158 at DeepSeek-V3). With
# two compute warpgroups (`weight_grad_tiles` below `WEIGHT_GRAD_SHARED_SM_GROUPS` groups) the
# kernel is always the warp-specialized one: on one H100 at 3 stages, 515 -> 559 TF/s at one
# rank of DeepSeek-V3 at EP=8 and 494 -> 583 at Mixtral (`bench_layer.py --tune
# weight_grad_wgs`).
WEIGHT_GRAD_SPECIALIZED = False
# From this many groups the weight gradient runs two persistent CTAs per SM at 3 stages. With
# many groups each holds a few hundred rows, so an output tile is a step or a few of the
# reduction, then its store: one CTA alone leaves the matrix units idle through each tile's
# pipeline fill and store, and a second CTA's tiles fill them. NOTES (one H100, `bench_layer.py
# --tune weight_grad`, bf16, 4096 tokens' rows, skewed groups): DeepSeek-V3's 256 experts 157 ->
# 204 TF/s, Qwen3's 128 254 -> 269; 32 experts 394 -> 418 (32 x 4096 x 1536) and 497 -> 494
# (one rank of DeepSeek-V3 at EP=8); Mixtral's 8 experts 500 -> 454. Two CTAs give the same
# bits (each output tile is one CTA's, reduced in the same order).
WEIGHT_GRAD_SHARED_SM_GROUPS = 64

# Decode reads every expert's weights once per call (the bound), and a column tile's weights
# once per row tile: so the row tile follows the rows an expert gets, about S * K / E of a slab
# of S rows, while a small tile wastes no work on few rows. By slab size, the first of these
# that divides the shape (the measurements behind them: docs/performance.md).
SLAB_TILE_RULE = (
    (256, SlabTiles(16, 128, 64, 4, 3)),
    (512, SlabTiles(32, 128, 64, 4, 3)),
    (None, SlabTiles(64, 256, 64, 8, 3)),
)


@dataclasses.dataclass(frozen=True)
class Overrides:
  """What `override` replaces (None: the tables' and rules' own choice).

  Attributes:
    impl: what `grouped_matmul(..., impl='auto')` means: 'auto', 'mosaic' or 'xla'.
    gemm_tiles: the Hopper forward kernel's tiles for every shape.
    weight_grad_tiles: the Hopper weight-gradient kernel's tiles for every shape.
    weight_grad_specialized: the warp-specialized weight-gradient kernel (True) or the
      one-warpgroup one (False).
    weight_grad_aligned: whether the weight gradient copies its operands so that each group
      starts at a multiple of `block_k` rows, zeros after its last row (`layout.aligned_blocks`),
      and reduces them with no rows to select away (True), or reduces the rows where they are,
      selecting away other groups' rows in the blocks a group boundary cuts (None, the default,
      or False).
    slab_tiles: the slab kernels' tiles for every slab.
    fused_mlp: whether `expert_mlp` takes the fused kernels where they run (None: yes, where
      the grouped GEMM takes the Mosaic kernels); False: the unfused grouped GEMMs.
    fused_tiles: the fused expert kernels' tiles for every shape.
    fused_gated_tiles: the fused gated projections' tiles for every shape, over `fused_tiles`
      (`compute_wgs` 2: the warp-specialized kernel, each compute warpgroup `block_n` of the
      CTA's columns of both projections).
    fused_hidden_grad_tiles: the fused hidden gradient's tiles for every shape, over
      `fused_tiles` (`compute_wgs` 2: the warp-specialized kernel).
    fp8_weight_grad: whether the FP8 recipe's weight gradients run in FP8 (None, the default,
      or True: the tokens quantised per 128 per channel, `fp8_weight_grads`) or in bf16 on
      the dequantised rows (False).
    kernel_sms: the SMs the persistent Hopper kernels' grid is sized for (None: the device's;
      the grid is this times the tiles' `ctas_per_sm`). Fewer leave SMs to kernels beside
      them (a persistent CTA holds its share of an SM to the kernel's end, so a kernel that
      took SMs first makes as many CTAs wait, and one launched after waits for the whole
      kernel); more than the device has makes CTAs queue for SMs, in turn with other
      kernels' blocks, as SMs free up.
    compile_ahead: whether a kernel traced inside a program is also compiled alone on a pool
      thread while the program's trace and XLA's passes go on (None, the default, or True;
      `jax_ep.experts.compile_ahead`), so that XLA's compile of the program finds it built.
  """
  impl: str = "auto"
  gemm_tiles: KernelTiles | None = None
  weight_grad_tiles: KernelTiles | None = None
  weight_grad_specialized: bool | None = None
  weight_grad_aligned: bool | None = None
  slab_tiles: SlabTiles | None = None
  fused_mlp: bool | None = None
  fused_tiles: KernelTiles | None = None
  fused_gated_tiles: KernelTiles | None = None
  fused_hidden_grad_tiles: KernelTiles | None = None
  fp8_weight_grad: bool | None = None
  kernel_sms: int | None = None
  compile_ahead: bool | None = None


_OVERRIDES = contextvars.ContextVar("jax_ep_expert_overrides", default=Overrides())
_IMPLS = ("auto", "mosaic", "xla")


def current() -> Overrides:
  """The overrides in force (those of the innermost `override` block)."""
  return _OVERRIDES.get()


@contextlib.contextmanager
def override(**fields):
  """Within the block, the expert kernels take these choices (fields of `Overrides`) wherever
  a program is traced: e.g. `override(impl='xla')` times a whole layer on `lax.ragged_dot`,
  `override(slab_tiles=SlabTiles(...))` the slab kernels at other tiles. Blocks nest; a field
  not named keeps the enclosing block's value. A function jax traced before the block keeps
  that trace."""
  names = {f.name for f in dataclasses.fields(Overrides)}
  unknown = sorted(set(fields) - names)
  if unknown:
    raise TypeError(f"jax_ep.experts.override: unknown field(s) {unknown}; the fields are "
                    f"{sorted(names)}")
  if "impl" in fields and fields["impl"] not in _IMPLS:
    raise ValueError(f"jax_ep.experts.override: impl must be 'auto', 'mosaic' or 'xla', got "
                     f"{fields['impl']!r}")
  sms = fields.get("kernel_sms")
  if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
    raise ValueError(f"jax_ep.experts.override: kernel_sms must be a positive int or None, got "
                     f"{sms!r}")
  token = _OVERRIDES.set(dataclasses.replace(_OVERRIDES.get(), **fields))
  try:
    yield
  finally:
    _OVERRIDES.reset(token)


def cache_per_overrides(factory):
  """`functools.cache` of `factory`, keyed on the overrides in force as well as its arguments.

  NOTES: for the factories of the functions a trace calls whose choices read the overrides
  (tiles, kernels, probes): jax keeps the jaxpr of a `custom_vmap`'s function per function
  object and operand types, whatever else differs, so a factory cached on its arguments alone
  handed a program traced inside `override(...)` the function, and so the kernels, of an
  earlier trace made outside it."""
  cached = functools.cache(lambda overrides, *args: factory(*args))

  @functools.wraps(factory)
  def make(*args):
    return cached(current(), *args)
  return make


def tile_config(rows: int, groups: int, k: int, n: int, dtype=jnp.bfloat16,
                arch: str = HOPPER) -> KernelTiles | None:
  """The forward kernel's tiles for `[rows, k] x [groups, k, n]`, or None where they cannot
  divide it (`k` must be a multiple of `block_k`, `n` of `block_n`)."""
  del rows  # the work list makes the row count matter only through the groups' boundaries
  forced = current().gemm_tiles
  if forced is not None:
    return forced if k % forced.block_k == 0 and n % (
        forced.block_n * forced.compute_wgs) == 0 else None
  table = TILE_TABLES.get((arch, np.dtype(dtype)), {})
  if (groups, k, n) in table:
    return table[(groups, k, n)]
  block_k = 64
  if k % block_k:
    return None
  # The warp-specialized kernel (two compute warpgroups of block_n columns each) where N
  # holds its CTA tile: the fastest at every measured shape; the one-warpgroup kernel else.
  if n % 256 == 0:
    return KernelTiles(block_m=ROW_TILE, block_n=128, block_k=block_k, stages=3, band=1,
                       compute_wgs=2)
  if n % 128 == 0:
    return KernelTiles(block_m=ROW_TILE, block_n=64, block_k=block_k, stages=6, band=4,
                       compute_wgs=2)
  if n % 64 == 0:
    return KernelTiles(block_m=ROW_TILE, block_n=64, block_k=block_k, stages=4, band=4)
  return None


def weight_grad_tiles(k: int, n: int, groups: int) -> KernelTiles | None:
  """The weight-gradient kernel's tiles for `[groups, k, n]`: its output tiled
  `block_m x block_n`, the rows reduced `block_k` at a time, two CTAs per SM from
  `WEIGHT_GRAD_SHARED_SM_GROUPS` groups; None where they do not divide `k` and `n`."""
  forced = current().weight_grad_tiles
  if forced is not None:
    rows = forced.block_m * forced.compute_wgs
    return forced if k % rows == 0 and n % forced.block_n == 0 else None
  if k % ROW_TILE:
    return None
  block_n = next((b for b in (128, 64) if n % b == 0), None)
  if block_n is None:
    return None
  if groups >= WEIGHT_GRAD_SHARED_SM_GROUPS:
    return KernelTiles(block_m=ROW_TILE, block_n=block_n, block_k=64, stages=3, band=4,
                       ctas_per_sm=2)
  if block_n == 128 and k % (2 * ROW_TILE) == 0:
    # The warp-specialized kernel with two compute warpgroups: a 256 x 128 output tile, each
    # `dy` block loaded once for both (its 3 stages and both staged tiles fill an SM).
    return KernelTiles(block_m=ROW_TILE, block_n=128, block_k=64, stages=3, band=4,
                       compute_wgs=2)
  return KernelTiles(block_m=ROW_TILE, block_n=block_n, block_k=64, stages=4, band=4)


# An H100's or H200's shared memory per SM (bytes); each CTA on it also takes 1 KiB.
SMEM_PER_SM = 233472


def weight_grad_run_tiles(itemsize: int = 2) -> list[KernelTiles]:
  """The weight gradient's pipelines through runs of groups (`KernelTiles.groups_per_run`) that
  `bench_layer.py --tune weight_grad_runs` times: runs of 4, 16 and 64 groups, 64 or 128 rows
  a step, 2 to 4 stages, 1 or 2 CTAs an SM, where a CTA's ring of stages and its staged output
  tile (held together) fit its share of an SM's shared memory."""
  out = []
  for run, bk, stages, per_sm in itertools.product((4, 16, 64), (64, 128), (2, 3, 4), (1, 2)):
    smem = (stages * bk * 2 * ROW_TILE + ROW_TILE * ROW_TILE) * itemsize
    if per_sm * (smem + 1024) <= SMEM_PER_SM:
      out.append(KernelTiles(ROW_TILE, ROW_TILE, bk, stages, 4, ctas_per_sm=per_sm,
                             groups_per_run=run))
  return out


def weight_grad_specialized() -> bool:
  forced = current().weight_grad_specialized
  return WEIGHT_GRAD_SPECIALIZED if forced is None else forced


def weight_grad_aligned() -> bool:
  """Whether the weight gradient reduces group-aligned copies of its operands
  (`Overrides.weight_grad_aligned`; off unless asked: the copies cost what the selects they
  save do, or more, at the model shapes; docs/performance.md)."""
  return bool(current().weight_grad_aligned)


def fused_tiles(k: int, n: int) -> KernelTiles | None:
  """The fused gated projections' tiles (`jax_ep/experts/hopper_fused.py`) for a `[rows, k]`
  operand and `[rows, n]` outputs, or None where they do not divide `k` and `n`. NOTES: one
  warpgroup holds both `block_m x block_n` fp32 accumulators (gate and up) in registers: 64
  columns keep them within Hopper's limits. The hidden and input gradients (one accumulator)
  take 128 (`fused_hidden_grad_tiles`, `fused_input_grad_tiles`). Where `n` holds 128
  columns, the warp-specialized kernel (`compute_wgs` 2): two compute warpgroups of 64
  columns each, a third loading, at `FUSED_SPECIALIZED_STAGES`; the one-warpgroup kernel
  else, or as `override(fused_gated_tiles=...)` or `override(fused_tiles=...)` names."""
  forced = current().fused_gated_tiles or current().fused_tiles
  if forced is not None:
    cta_n = forced.block_n * forced.compute_wgs
    return forced if k % forced.block_k == 0 and n % cta_n == 0 else None
  if k % 64 or n % 64:
    return None
  if n % 128 == 0:
    return KernelTiles(block_m=ROW_TILE, block_n=64, block_k=64,
                       stages=FUSED_SPECIALIZED_STAGES["gated"], band=4, compute_wgs=2)
  return KernelTiles(block_m=ROW_TILE, block_n=64, block_k=64, stages=4, band=4)


# The warp-specialized fused kernels' stages. NOTES (one H100, `bench_expert_mlp.py --impls
# fused --tiles 128,64,64,S,4,2`, forward / forward + backward against the one-warpgroup
# kernels in the same run, us): the gated projections at 3 stages are the faster at the three
# shapes timed (one rank of DeepSeek-V3 at EP=8 4881 -> 4353, Mixtral 4826 -> 4251, 32 x 4096
# x 1536 1245 -> 1098; 4 stages 4554, 4445, 1090); the hidden gradient at 4 (what the backward
# took beyond the forward: 12073 at 3 against 11769 at 4, 12159 against 12216, 3078 against
# 3006).
FUSED_SPECIALIZED_STAGES = {"gated": 3, "hidden_grad": 4}


def fused_hidden_grad_tiles(k: int, n: int) -> KernelTiles | None:
  """The tiles of the fused hidden gradient (`dy @ w_down^T` with the activation's derivative:
  one accumulator, two loaded tiles, three outputs). NOTES: 128 columns where they divide `n`:
  at 64 each reduction step's wgmma is half as wide and the row operand is read from L2 twice
  as often. The epilogue then runs on `HIDDEN_GRAD_EPILOGUE_COLUMNS` at a time, and the loaded
  and staged tiles (64 + 96 KiB) fit beside 4 stages (128 KiB): the staged ones take the
  stages' place once the reduction ends. Where `n` holds 128 columns and no
  `override(fused_tiles=...)` is set, the warp-specialized kernel (`compute_wgs` 2: each
  compute warpgroup 64 of the CTA's 128 columns, each output staged on its own); the input
  gradient's rule else, or the tiles `override(fused_hidden_grad_tiles=...)` names."""
  forced = current().fused_hidden_grad_tiles
  if forced is not None:
    cta_n = forced.block_n * forced.compute_wgs
    return forced if k % forced.block_k == 0 and n % cta_n == 0 else None
  if current().fused_tiles is None and k % 64 == 0 and n % 128 == 0:
    return KernelTiles(block_m=ROW_TILE, block_n=64, block_k=64,
                       stages=FUSED_SPECIALIZED_STAGES["hidden_grad"], band=4, compute_wgs=2)
  return fused_input_grad_tiles(k, n)


# The fused hidden gradient's epilogue width. ptxas for sm_90a at 128 columns: the whole tile
# at once spills 3282 bytes a thread, 64 columns 672, 32 columns 24, 16 none (244 registers).
HIDDEN_GRAD_EPILOGUE_COLUMNS = 16
# The same with two compute warpgroups of 64 columns (each output staged on its own, the
# epilogue run again for each, within the warp-specialized kernel's 168 registers): at one
# rank of DeepSeek-V3 at EP=8, 16 columns spill 40-44 bytes a thread, 32 none.
HIDDEN_GRAD_EPILOGUE_COLUMNS_SPECIALIZED = 32


def hidden_grad_epilogue_columns(tiles: KernelTiles) -> int:
  """The fused hidden gradient's epilogue width at `tiles`."""
  columns = (HIDDEN_GRAD_EPILOGUE_COLUMNS_SPECIALIZED if tiles.compute_wgs > 1
             else HIDDEN_GRAD_EPILOGUE_COLUMNS)
  return min(tiles.block_n, columns)


def fused_input_grad_tiles(k: int, n: int) -> KernelTiles | None:
  """The tiles of the fused input gradient (two passes into one accumulator, `n` columns)."""
  forced = current().fused_tiles
  if forced is not None:
    return forced if k % forced.block_k == 0 and n % forced.block_n == 0 else None
  if k % 64 or n % 64:
    return None
  block_n = 128 if n % 128 == 0 else 64
  return KernelTiles(block_m=ROW_TILE, block_n=block_n, block_k=64, stages=4, band=4)


def fallback_tiles(config: KernelTiles, n: int):
  """`config`, then tiles that need less shared memory, in the order tried where it does not
  build (e.g. a float32 result's staging buffers beside the warp-specialized kernel's
  stages): fewer stages of the same kernel, then the one-warpgroup kernel."""
  yield config
  if config.compute_wgs > 1:
    for stages in range(config.stages - 1, 1, -1):
      yield dataclasses.replace(config, stages=stages)
  block_n = 128 if n % 128 == 0 else 64
  for stages in (4, 3, 2):
    plain = KernelTiles(block_m=config.block_m, block_n=block_n, block_k=config.block_k,
                        stages=stages, band=4)
    if plain != config:
      yield plain


def slab_divides(tiles: SlabTiles, slab: int, hidden: int, ffn: int) -> str | None:
  """Why `tiles` do not divide slabs of `slab` rows of `hidden`, `ffn` (None: they do)."""
  for name, size, block in (("rows per slab", slab, tiles.block_m),
                            ("hidden", hidden, tiles.block_k), ("hidden", hidden, tiles.block_n),
                            ("ffn", ffn, tiles.block_k), ("ffn", ffn, tiles.block_n)):
    if size % block:
      return f"{name} = {size} is not a multiple of {block}"
  return None


def slab_tiles(slab: int, hidden: int, ffn: int) -> SlabTiles | None:
  """The slab kernels' tiles for slabs of `slab` rows (`SLAB_TILE_RULE`, or the override), or
  None when none of them divides the shape."""
  forced = current().slab_tiles
  if forced is not None:
    return forced if slab_divides(forced, slab, hidden, ffn) is None else None
  start = next(i for i, (most, _) in enumerate(SLAB_TILE_RULE) if most is None or slab <= most)
  for _, tiles in reversed(SLAB_TILE_RULE[:start + 1]):
    if slab_divides(tiles, slab, hidden, ffn) is None:
      return tiles
  return None


def smallest_slab_tiles() -> SlabTiles:
  """The tiles whose divisibility a slab that no tiles divide is explained by."""
  return current().slab_tiles or SLAB_TILE_RULE[0][1]


# ----------------------------------------------------------------------------------------------
# FP8 (`jax_ep/experts/hopper_fp8.py`): e4m3 operands with 128-channel / 128x128-block scales.
# `block_k` is the scales' block (each 128-deep block's product is promoted into the fp32 total)
# and a CTA's columns, `block_n * compute_wgs`, divide 128 (one weight scale per column tile).
# A compute warpgroup holds its fp32 totals and one block's product in registers, so the
# warp-specialized kernels split a 128 x 128 tile's rows between two compute warpgroups
# (DeepGEMM's shape: one promotes while the other's wgmma runs): 64 x 128 each, 64 + 64
# registers per thread for the forward, 3 x 64 for the gated kernel's two totals (`block_n`
# 128 also keeps `h`'s quantisation block inside the tile). Shared memory (of Hopper's 227
# KiB): the forward's 4 stages of 32.5 KiB beside 32 KiB of staged bf16 output (64 KiB fp32);
# the gated kernel's 3 stages of 48.5 KiB beside 64 KiB (h, its scales in 128-byte rows, and
# gate and up one after the other in one buffer). The input gradient of both projections is
# the forward kernel's product over `[dgate | dup]` (K = 2F). `FP8_ONE_WARPGROUP`: the
# one-warpgroup form, which the benchmark's tile sweep compares.
FP8_BLOCK = 128
_FP8_FORWARD = KernelTiles(block_m=ROW_TILE, block_n=128, block_k=FP8_BLOCK, stages=4, band=4,
                           compute_wgs=2)
_FP8_GATED = KernelTiles(block_m=ROW_TILE, block_n=128, block_k=FP8_BLOCK, stages=3, band=4,
                         compute_wgs=2)
FP8_ONE_WARPGROUP = KernelTiles(block_m=64, block_n=128, block_k=FP8_BLOCK, stages=4, band=4)

# The forward's tiles for shapes `(groups, K, N)`: the five model shapes' up / gate (K = H,
# N = F) and down (K = F, N = H) products. NOTES: not yet measured on an H200; each entry is
# the rule's choice, pinned where a measurement (`benchmarks/bench_fp8_gemm.py --tune`) will
# replace it, as the bf16 table's were.
FP8_TILE_TABLE: dict[tuple[int, int, int], KernelTiles] = {
    shape: _FP8_FORWARD
    for groups, hidden, ffn in ((256, 7168, 2048),  # DeepSeek-V3
                                (128, 2048, 768),  # Qwen3-30B-A3B
                                (32, 4096, 1536),
                                (8, 4096, 14336),  # Mixtral 8x7B
                                (32, 7168, 2048))  # DeepSeek-V3 at EP=8, one rank
    for shape in ((groups, hidden, ffn), (groups, ffn, hidden))
}


def fp8_tile_config(groups: int, k: int, n: int) -> KernelTiles | None:
  """The FP8 forward kernel's tiles for `[rows, k] x [groups, n, k]`, or None where the scales'
  blocks do not divide it (`k` and `n` multiples of 128)."""
  if k % FP8_BLOCK or n % FP8_BLOCK:
    return None
  return FP8_TILE_TABLE.get((groups, k, n), _FP8_FORWARD)


# The FP8 weight gradient (`hopper_fp8_wgrad.fp8_weight_grad_kernel`): a `[P, Q]` output tile
# per group, reduced over the group's 128-token blocks; the two compute warpgroups split the tile's
# P rows (64 x 128 each: 64 + 64 registers per thread), 4 stages of 33 KiB (both operands'
# 128 x 128 e4m3 tiles and their scales) beside 32 KiB of staged bf16 output.
_FP8_WEIGHT_GRAD = KernelTiles(block_m=128, block_n=128, block_k=FP8_BLOCK, stages=4, band=4,
                               compute_wgs=2)


def fp8_weight_grad_tiles(p: int, q: int) -> KernelTiles | None:
  """The FP8 weight gradient's tiles for `[G, P, Q]` outputs, or None where `p` or `q` is not
  a multiple of 128."""
  if p % FP8_BLOCK or q % FP8_BLOCK:
    return None
  return _FP8_WEIGHT_GRAD


def fp8_gated_tiles(k: int, n: int) -> KernelTiles | None:
  """The FP8 gated kernel's tiles (gate and up of a `[rows, k]` operand, `[rows, n]` outputs),
  or None where `k` or `n` is not a multiple of 128."""
  if k % FP8_BLOCK or n % FP8_BLOCK:
    return None
  return _FP8_GATED


def fp8_weight_grads() -> bool:
  """Whether the FP8 MLP's weight gradients run in FP8 (the default; bf16 with
  `override(fp8_weight_grad=False)`).

  NOTES: FP8 by default, DeepSeek-V3's recipe: on Hopper the layer's forward + backward runs
  faster with them than with the bf16 weight-gradient kernel (their column copies included),
  and the example trains to the same held-out loss either way (docs/performance.md). On the
  fallback (no Hopper kernels) they cost more than bf16 and only add the rounding: they stay
  the default there too, so that every backend computes the same recipe."""
  return current().fp8_weight_grad is not False
