"""The experts' MLPs over dispatched rows: `expert_mlp` (the high-throughput layout: rows
grouped by expert, on the grouped GEMM or the fused Hopper kernels), `expert_mlp_slabs` (the
low-latency slabs), `shared_mlp` (the dense expert every token takes), and the activations they
run. `jax_ep.moe_mlp` (jax_ep/layer.py) wraps them with the router, dispatch and combine.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep._native.fp8 import unpack_ue8m0
from jax_ep.backends.primitives import quantize
from jax_ep.config import RowFormat
from jax_ep.experts import slab as slab_mlp
from jax_ep.experts.fp8 import (Fp8Weights, check_fp8_dims, check_fp8_rows,
                                quantize_weights)
from jax_ep.experts.mlp_fp8 import (fp8_expert_mlp, fp8_mlp_impl, quantize_rows,
                                     takes_row_kernels)
from jax_ep.experts.api import grouped_matmul
from jax_ep.experts.checks import check_groups
from jax_ep.experts.layout import contiguous_offsets
from jax_ep.experts.mlp import fused_expert_mlp, fused_mlp_impl
from jax_ep.layer_checks import check_expert_weights

_logger = logging.getLogger("jax_ep")
_SAID_SLABS: set[str] = set()
_SAID_MLP: set = set()

# The experts' activations: the gated ones (`act(x @ w_gate) * (x @ w_up)`, three matrices) and
# the plain two-matrix MLPs (`act(x @ w_gate)`, no `w_up`). GELU is jax.nn.gelu's default, the
# tanh approximation (as in Flax, GPT-2 and Gemma's GeGLU).
ACTIVATIONS = ("swiglu", "geglu", "gelu", "silu")
GATED_ACTIVATIONS = ("swiglu", "geglu")


def check_activation(fn: str, activation) -> None:
  """`activation` is one of `ACTIVATIONS`, or an error naming `fn`."""
  if not isinstance(activation, str) or activation not in ACTIVATIONS:
    raise ValueError(f"jax_ep.{fn}: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                     f"got {activation!r}")


def check_up(fn: str, name: str, w_up, activation: str) -> None:
  """A gated activation needs its up projection; a plain one must not get one (it would be
  silently unused)."""
  if activation in GATED_ACTIVATIONS and w_up is None:
    raise ValueError(f"jax_ep.{fn}: activation={activation!r} is gated and needs {name}, got "
                     f"None")
  if activation not in GATED_ACTIVATIONS and w_up is not None:
    raise ValueError(f"jax_ep.{fn}: activation={activation!r} is a two-matrix MLP with no up "
                     f"projection: {name} must be None, got an array of shape "
                     f"{getattr(w_up, 'shape', None)} (init_moe_params(..., "
                     f"activation={activation!r}) leaves it out)")


def _activate(gate, up, activation: str):
  """The hidden activation of the fp32 projections."""
  act = jax.nn.silu if activation in ("swiglu", "silu") else jax.nn.gelu
  return act(gate) * up if activation in GATED_ACTIVATIONS else act(gate)


def expert_mlp(x, w_gate, w_up, w_down, group_sizes, *, group_offsets=None,
               activation: str = "swiglu", fp8: bool = False, x_scales=None):
  """The experts over expert-grouped rows (`recv.x` of `dispatch`).

  Args:
    x: `[rows, H]` bf16, f16 or f32, grouped by expert; with `fp8`, also float8_e4m3fn rows
      with their `x_scales` (an fp8 dispatch's `recv.x` and `recv.scales`).
    w_gate: `[G, H, F]` in `x`'s dtype: gate (gated activations) or input projection.
    w_up: `[G, H, F]` up projection of the gated activations; None for the plain ones.
    w_down: `[G, F, H]`.
    group_sizes: `[G]` int32 rows of each expert.
    group_offsets: `[G]` int32 first row of each expert (`recv.group_offsets`; with a group's
      `expert_alignment` the experts' rows have padding between them); None: the experts' rows
      follow each other from row 0.
    activation: one of `ACTIVATIONS`.
    fp8: DeepSeek-V3's FP8 recipe (jax_ep/experts/mlp_fp8.py): the products of the forward
      and of the input gradient in FP8 (activations scaled per row per 128 channels, weights
      per 128 x 128 block, fp32 promotion every 128), the weight gradients in FP8 (bf16 with
      `jax_ep.experts.override(fp8_weight_grad=False)`), the result in bf16. The weights are
      bf16 / f32 masters (quantised here, once per call) or `jax_ep.Fp8Weights`
      (`jax_ep.quantize_weights`, e.g. once per step for several micro-batches); their
      gradients pass straight through to the masters. `x` in a floating dtype is quantised
      once (straight through); H and F must be multiples of 128.
    x_scales: with float8_e4m3fn `x`: `[rows, H / 128]` float32 (or `[rows, H / 512]` int32
      UE8M0 exponents), as `jax_ep.dispatch` returns them in `recv.scales`.

  Returns:
    `[rows, H]` in `x`'s dtype (fp32 accumulation, the hidden activation rounded to `x`'s
    dtype; with `fp8`, bf16). Rows outside the groups (past them, and the padding between
    them) are unspecified: no matmul reads them and the activation is row-local, so no result
    depends on them.

  On Hopper GPUs (bf16 / f16, sizes multiples of 64) the experts run fused kernels that never
  touch the rows outside the groups (jax_ep/experts/mlp.py: gate and up in one kernel with
  the activation in its epilogue, the activation's derivative fused into the backward, bf16
  residuals); elsewhere three `grouped_matmul`s with the activation between them. The choice
  and its reason are logged once per shape (`jax_ep` logger).
  """
  check_activation("expert_mlp", activation)
  check_up("expert_mlp", "w_up", w_up, activation)
  if fp8 or x_scales is not None or isinstance(w_gate, Fp8Weights):
    return _fp8_expert_mlp(x, x_scales, w_gate, w_up, w_down, group_sizes, group_offsets,
                           activation, fp8)
  if getattr(x, "ndim", None) == 2:  # else grouped_matmul names x
    check_expert_weights("expert_mlp", ("w_gate", "w_up", "w_down"), w_gate, w_up, w_down,
                          experts=None, hidden=x.shape[1], letter="G")
    check_groups(x.shape[0], group_sizes, group_offsets, "jax_ep.expert_mlp")
  if group_offsets is None:  # computed once: the products share it (one residual)
    group_offsets = contiguous_offsets(group_sizes)
  weights = [w for w in (w_gate, w_up, w_down) if w is not None]
  if getattr(x, "ndim", None) == 2 and all(
      getattr(w, "ndim", None) == 3 and w.dtype == x.dtype for w in weights):
    fused, detail = fused_mlp_impl(x.shape[0], w_gate.shape[0], x.shape[1], w_gate.shape[2],
                                   x.dtype, activation)
    key = (fused, detail, x.shape, w_gate.shape, activation)
    if key not in _SAID_MLP:
      _SAID_MLP.add(key)
      _logger.info("jax_ep.expert_mlp %s x %s %s: %s (%s)", list(x.shape), list(w_gate.shape),
                   activation, "fused" if fused else "unfused", detail)
    if fused:
      return fused_expert_mlp(x, w_gate, w_up, w_down,
                              jnp.asarray(group_sizes).astype(jnp.int32),
                              jnp.asarray(group_offsets).astype(jnp.int32), activation)
  f32 = jnp.float32
  matmul = functools.partial(grouped_matmul, group_offsets=group_offsets,
                             preferred_element_type=f32)
  gate = matmul(x, w_gate, group_sizes)
  up = None if w_up is None else matmul(x, w_up, group_sizes)
  h = _activate(gate, up, activation).astype(x.dtype)
  return matmul(h, w_down, group_sizes).astype(x.dtype)


def _fp8_expert_mlp(x, x_scales, w_gate, w_up, w_down, group_sizes, group_offsets,
                    activation: str, fp8: bool):
  """`expert_mlp(..., fp8=True)`: checks, quantises what comes unquantised, runs the recipe."""
  fn = "expert_mlp"
  if not fp8:
    raise ValueError(f"jax_ep.{fn}: x_scales and jax_ep.Fp8Weights are the FP8 recipe's "
                     f"operands: pass fp8=True")
  if getattr(x, "ndim", None) != 2:
    raise ValueError(f"jax_ep.{fn}: x must be [rows, H], got shape {getattr(x, 'shape', None)}")
  hidden = x.shape[1]
  quantised = np.dtype(x.dtype) == np.dtype(jnp.float8_e4m3fn)
  if quantised and x_scales is None:
    raise ValueError(f"jax_ep.{fn}: float8_e4m3fn x needs its x_scales [rows, H / 128] (an fp8 "
                     f"dispatch's recv.scales)")
  if not quantised and x_scales is not None:
    raise ValueError(f"jax_ep.{fn}: x_scales go with float8_e4m3fn x; x is {x.dtype} and is "
                     f"quantised here")
  if not quantised and not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"jax_ep.{fn}: x must be floating or float8_e4m3fn, got {x.dtype}")
  # An Fp8Weights' `shape` is its master's [G, K, N].
  check_expert_weights(fn, ("w_gate", "w_up", "w_down"), w_gate, w_up, w_down, experts=None,
                       hidden=hidden, letter="G")
  for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if w is not None and not isinstance(w, Fp8Weights) and not jnp.issubdtype(w.dtype,
                                                                             jnp.floating):
      raise TypeError(f"jax_ep.{fn}: {name} must be floating (a master weight) or "
                      f"jax_ep.Fp8Weights, got {w.dtype}")
  check_fp8_dims(fn, "w_gate", w_gate.shape, "H and F")
  check_groups(x.shape[0], group_sizes, group_offsets, f"jax_ep.{fn}")
  group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
  group_offsets = (contiguous_offsets(group_sizes) if group_offsets is None
                   else jnp.asarray(group_offsets).astype(jnp.int32))
  if quantised:
    if getattr(x_scales, "dtype", None) == jnp.int32:
      x_scales = unpack_ue8m0(x_scales)
    check_fp8_rows(fn, x, x_scales)
  weights = [w if w is None or isinstance(w, Fp8Weights) else quantize_weights(w)
             for w in (w_gate, w_up, w_down)]
  groups, _, ffn = weights[0].shape
  fused, detail = fp8_mlp_impl(x.shape[0], groups, hidden, ffn, activation)
  if not quantised:
    x, x_scales = (quantize_rows(x) if fused and takes_row_kernels(x.shape)
                   else quantize(x, RowFormat.FP8))
  key = ("fp8", fused, detail, x.shape, weights[0].shape, activation)
  if key not in _SAID_MLP:
    _SAID_MLP.add(key)
    _logger.info("jax_ep.expert_mlp fp8 %s x %s %s: %s (%s)", list(x.shape),
                 list(weights[0].shape), activation, "fused" if fused else "unfused", detail)
  return fp8_expert_mlp(x, x_scales, *weights, group_sizes, group_offsets, activation, fused)


def expert_mlp_slabs(rows, w_gate, w_up, w_down, count, *, impl: str = "auto"):
  """SwiGLU experts over the low-latency slabs: `[L, S, H] -> [L, S, H]`, expert `l` on the first
  `count[l]` rows of slab `l` (fp32 accumulation, the hidden activation rounded to the rows'
  dtype); rows past `count[l]` are unspecified, as the dispatch leaves them.

  On GPUs the experts stop at each count (jax_ep/experts/slab.py: Pallas kernels that skip
  the row tiles past it, so decode computes `T * K` rows rather than `L * S`); elsewhere, and for
  slabs the kernels' tiles do not divide, a batched matmul over whole slabs with the padding
  masked.
  `impl`: "auto", "pallas", "interpret" (the kernels in Pallas's interpreter) or "dense"."""
  name = slab_mlp.resolve_impl(impl, rows.shape, w_gate.shape[2], rows.dtype)
  if name not in _SAID_SLABS:
    _SAID_SLABS.add(name)
    _logger.info("jax_ep.expert_mlp_slabs %s: %s", list(rows.shape), name)
  return slab_mlp.slab_mlp(rows, w_gate, w_up, w_down, count, impl=name)


def shared_mlp(x, w_gate, w_up, w_down, *, activation: str = "swiglu"):
  """The dense expert every token goes through: `[T, H] -> [T, H]`, weights `[H, Fs]`,
  `[H, Fs]` (None for the plain activations), `[Fs, H]` in `x`'s dtype; same precision as
  `expert_mlp`."""
  check_activation("shared_mlp", activation)
  check_up("shared_mlp", "w_up", w_up, activation)
  f32 = jnp.float32
  gate = jnp.dot(x, w_gate, preferred_element_type=f32)
  up = None if w_up is None else jnp.dot(x, w_up, preferred_element_type=f32)
  h = _activate(gate, up, activation).astype(x.dtype)
  return jnp.dot(h, w_down, preferred_element_type=f32).astype(x.dtype)
