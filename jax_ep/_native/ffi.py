"""Loads the compiled extension (if it was built) and registers its FFI targets with XLA."""

from __future__ import annotations

import functools

import jax


_import_error: str | None = None


@functools.cache
def extension():
  """The `_jax_ep_ffi` module, or None when the package was built without CUDA (or the
  extension does not load here: `why_unavailable()` says why)."""
  global _import_error
  try:
    from jax_ep import _jax_ep_ffi  # pytype: disable=import-error
  except ImportError as e:
    _import_error = f"{type(e).__name__}: {e}"
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


def why_unavailable() -> str | None:
  """Why `cuda_available()` is False (the extension's import error, or that JAX sees no GPU);
  None where it is True."""
  if extension() is None:
    return f"the jax_ep CUDA extension did not load: {_import_error}"
  if not cuda_available():
    try:
      platforms = sorted({d.platform for d in jax.devices()})
    except RuntimeError as e:
      platforms = [f"none ({e})"]
    return f"JAX sees no CUDA GPU (platforms: {platforms})"
  return None
