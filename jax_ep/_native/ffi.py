"""Loads the compiled extension (if it was built) and registers its FFI targets with XLA."""

from __future__ import annotations

import functools

import jax


@functools.cache
def extension():
  """The `_jax_ep_ffi` module, or None when the package was built without CUDA."""
  try:
    from jax_ep import _jax_ep_ffi  # pytype: disable=import-error
  except ImportError:
    return None
  for name, capsule in _jax_ep_ffi.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  return _jax_ep_ffi


def cuda_available() -> bool:
  """True when the extension is built and JAX sees at least one CUDA GPU."""
  if extension() is None:
    return False
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False
