"""Builds known to succeed: the expert kernels' configurations that the kernel choice takes
without compiling a probe of them first.

The kernel choice compiles a shape's kernels once (its probe) so that one that does not build
falls back instead of failing the user's program; that doubles the Mosaic GPU compile time of a
first step. Whether a kernel builds depends on what fixes its shared memory: its tiles, dtypes
and epilogue, not the row, group, K or N counts, which change loop bounds, array extents and how
ptxas allocates registers (it spills rather than fails). The configurations the tables and rules
of `jax_ep/experts/configs.py` give at sizes that are multiples of 128 are listed here and take
no probe; tests/test_hopper_aot.py compiles each for sm_90a on every CI run (the grouped GEMM at
one reduction step and at several). Any other tiles, dtype or activation (an override, an odd
size) is probed.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np

from jax_ep.experts.configs import (HOPPER, TILE_TABLES, WEIGHT_GRAD_SHARED_SM_GROUPS,
                                    KernelTiles, fp8_gated_tiles, fp8_tile_config,
                                    fp8_weight_grad_tiles, fp8_weight_grads,
                                    fused_hidden_grad_tiles, fused_input_grad_tiles,
                                    fused_tiles, tile_config, weight_grad_specialized,
                                    weight_grad_tiles)

def gmm_build(dtype, transpose_w: bool, tiles: KernelTiles, out_dtype) -> tuple:
  """The grouped GEMM kernel's build: what decides whether it compiles."""
  return ("gmm", np.dtype(dtype).name, bool(transpose_w), tiles, np.dtype(out_dtype).name)


def fused_mlp_build(dtype, activation: str, hidden: int, ffn: int, groups: int) -> tuple:
  """The fused expert MLP's kernels (forward and backward, weight gradients included)."""
  return ("fused_mlp", np.dtype(dtype).name, activation, fused_tiles(hidden, ffn),
          fused_hidden_grad_tiles(hidden, ffn), fused_input_grad_tiles(ffn, hidden),
          weight_grad_tiles(hidden, ffn, groups), weight_grad_tiles(ffn, hidden, groups),
          weight_grad_specialized())


def fp8_gmm_build(tiles: KernelTiles) -> tuple:
  return ("fp8_gmm", tiles)


def fp8_mlp_build(activation: str, hidden: int, ffn: int, groups: int,
                  fp8_weight_grad: bool | None = None) -> tuple:
  """The FP8 MLP's kernels (the gated projections, the input gradient, the weight gradients:
  FP8, or bf16 with `override(fp8_weight_grad=False)`; `fp8_weight_grad` None: the override's
  choice)."""
  parts = 2 if activation in ("swiglu", "geglu") else 1  # the input gradient's K: parts * F
  if fp8_weight_grad is None:
    fp8_weight_grad = fp8_weight_grads()
  if not fp8_weight_grad:
    weight_grads = (weight_grad_tiles(hidden, ffn, groups), weight_grad_tiles(ffn, hidden, groups),
                    weight_grad_specialized())
  else:
    weight_grads = ("fp8", fp8_weight_grad_tiles(hidden, parts * ffn),
                    fp8_weight_grad_tiles(ffn, hidden))
  return ("fp8_mlp", activation, fp8_gated_tiles(hidden, ffn),
          fp8_tile_config(groups, parts * ffn, hidden), *weight_grads)


# The sizes the MLPs' known builds stand for: multiples of 128, of which a tile choice reads no
# more than the remainder by 256 (the two-warpgroup weight gradient's 256 rows), so that every
# hidden and ffn size that is a multiple of 128 makes one of these builds.
KNOWN_BUILD_SIZES = (128, 256)
# The group counts that stand for the weight gradient's grids (one CTA per SM, two).
KNOWN_BUILD_GROUPS = (2, WEIGHT_GRAD_SHARED_SM_GROUPS)
_ACTIVATIONS = ("swiglu", "geglu", "gelu", "silu")
_BF16_GEMM_TILES = sorted(
    {*TILE_TABLES[(HOPPER, np.dtype(jnp.bfloat16))].values(),
     *(tile_config(0, 0, 64, n) for n in (256, 128, 64))},
    key=dataclasses.astuple)
# The FP8 forward kernel's tiles: its table's and its rule's, the same at every shape.
_FP8_FORWARD = fp8_tile_config(0, 128, 128)


def _known_mlp_builds() -> dict[tuple, tuple[int, int, int]]:
  """Each MLP build as the defaults make it (bf16 fused; FP8 with its FP8 weight gradients:
  the bf16 ones are an override, probed), with the `(hidden, ffn, groups)` that make it
  first: what tests/hopper_aot_cases.py compiles it at."""
  builds = {}
  for sizes in itertools.product(KNOWN_BUILD_SIZES, KNOWN_BUILD_SIZES, KNOWN_BUILD_GROUPS):
    for activation in _ACTIVATIONS:
      builds.setdefault(fused_mlp_build(jnp.bfloat16, activation, *sizes), sizes)
      builds.setdefault(fp8_mlp_build(activation, *sizes, True), sizes)
  return builds


KNOWN_MLP_BUILDS = _known_mlp_builds()
KNOWN_BUILDS: frozenset = frozenset(
    [gmm_build(jnp.bfloat16, transpose_w, tiles, jnp.bfloat16)
     for transpose_w in (False, True) for tiles in _BF16_GEMM_TILES]
    + [fp8_gmm_build(_FP8_FORWARD)] + list(KNOWN_MLP_BUILDS))
# tests/test_hopper_aot.py turns this off to compile every known build.
TRUST_KNOWN_BUILDS = True


# Mosaic tiles an operand's row dimension by 8: a row count off that tiling fails in lowering
# whatever the build, so the known builds stand for row counts on it alone.
KNOWN_BUILD_ROW_TILE = 8


def known_to_build(build: tuple, rows: int) -> bool:
  """Whether `build` (a `*_build` key) at `rows` rows needs no compile probe."""
  return TRUST_KNOWN_BUILDS and rows % KNOWN_BUILD_ROW_TILE == 0 and build in KNOWN_BUILDS
