"""Which implementation a grouped GEMM takes, and why: jax_ep's Mosaic GPU kernels on Hopper for
bf16 / f16 operands whose sizes its tiles divide and where the kernel builds, `lax.ragged_dot`
elsewhere. The first call of each choice is logged (`jax_ep` logger)."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.experts import builds, configs
from jax_ep.experts.configs import on_hopper
from jax_ep.experts.hopper import grouped_matmul_kernel

_logger = logging.getLogger("jax_ep")
MOSAIC_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_SAID: set = set()
_IMPLS = ("auto", "mosaic", "xla")


def grouped_matmul_impl(rows: int, groups: int, k: int, n: int, dtype, w_dtype=None,
                        *, transpose_w: bool = False, impl: str = "auto", out_dtype=None):
  """`(name, detail)` of the implementation `grouped_matmul` uses for this shape: `("mosaic",
  KernelTiles)` or `("xla", why the Mosaic kernel does not run it)`.

  Args:
    rows, groups, k, n: `x` is `[rows, k]`, the weights `[groups, k, n]`.
    dtype, w_dtype: the operands' dtypes (`w_dtype` defaults to `dtype`).
    transpose_w: the weights are stored `[groups, n, k]`.
    impl: 'auto' (what `jax_ep.experts.override(impl=...)` says, by default the Mosaic
      kernels where they run), 'mosaic' (raises where it cannot run) or 'xla'.
    out_dtype: the result's dtype (default `dtype`).
  """
  if impl not in _IMPLS:
    raise ValueError(f"jax_ep.grouped_matmul: impl must be 'auto', 'mosaic' or 'xla', "
                     f"got {impl!r}")
  if impl == "auto":
    impl = configs.current().impl
  if impl == "xla":
    return "xla", "asked for"
  dtype = np.dtype(dtype)
  w_dtype = dtype if w_dtype is None else np.dtype(w_dtype)
  why = None
  config = None
  if not on_hopper():
    why = "the Mosaic GPU kernel needs Hopper GPUs (compute capability 9.0)"
  elif dtype not in MOSAIC_DTYPES or w_dtype != dtype:
    why = (f"the Mosaic GPU kernel takes bf16 or f16 operands of one dtype, got {dtype} and "
           f"{w_dtype}")
  else:
    config = configs.tile_config(rows, groups, k, n, dtype)
    if config is None:
      why = f"its tiles do not divide K={k} (multiples of 64) or N={n} (multiples of 64)"
    else:
      out_dtype = dtype if out_dtype is None else np.dtype(out_dtype)
      first_why = None
      for candidate in configs.fallback_tiles(config, n):
        why = mosaic_compile_error(rows, groups, k, n, dtype, transpose_w, candidate,
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


@functools.cache
def mosaic_compile_error(rows, groups, k, n, dtype, transpose_w, config,
                         out_dtype) -> str | None:
  """Why the Mosaic kernel does not compile for this shape (e.g. its tiles exceed shared
  memory), or None. NOTES: compiled once per shape, on abstract operands, when the shape is
  first traced: a kernel that cannot build sends the shape to lax.ragged_dot (logged) instead
  of failing the user's whole program when XLA compiles it. A known build
  (`builds.KNOWN_BUILDS`) is not compiled."""
  if builds.known_to_build(builds.gmm_build(dtype, transpose_w, config, out_dtype), rows):
    return None
  w_shape = (groups, n, k) if transpose_w else (groups, k, n)
  operands = (jax.ShapeDtypeStruct((rows, k), dtype), jax.ShapeDtypeStruct(w_shape, dtype),
              jax.ShapeDtypeStruct((groups,), jnp.int32),
              jax.ShapeDtypeStruct((groups,), jnp.int32))
  try:
    product = lambda x, w, s, o: grouped_matmul_kernel(  # noqa: E731
        x, w, s, o, transpose_w=transpose_w, tiles=config, out_dtype=out_dtype)
    jax.jit(product).lower(*operands).compile()
  except Exception as e:  # noqa: BLE001 - any failure to build means: not this kernel
    return f"the Mosaic GPU kernel did not compile for it ({type(e).__name__}: " \
           f"{str(e).splitlines()[0][:200] if str(e) else ''})"
  return None


def say(name, detail, shape, op: str = "grouped_matmul"):
  """Logs the first use of each choice of `op` for each shape."""
  key = (op, name, str(detail), shape)
  if key not in _SAID:
    _SAID.add(key)
    _logger.info("jax_ep.%s %s: %s (%s)", op, shape, name, detail)

