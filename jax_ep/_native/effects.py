"""Settling JAX's runtime effect tokens after a jax_ep check failed inside a computation.

NOTES: a jax_ep host check that raises (an group op's timeout, a strict-mode drop), and a peer
handler that fails because an earlier call timed out, fail their XLA execution; the caller gets
the error. JAX keeps that execution's runtime token and waits on it again in its exit hook,
where the re-raised error takes the crash path: on a GPU job the coordination service then
aborts every process (exit code 134, seen on the H200). `settle()` waits on every pending token
once, logs the failures (already reported when they happened) and forgets them; it runs when a
failed group is closed and, if anything failed, at interpreter exit before JAX's own hook.
Tokens are per thread (JAX's runtime token set is thread-local): this settles the calling
thread's, and the exit hook the main thread's.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Callable

import jax  # noqa: F401 - JAX's exit hook must be registered before ours (atexit is LIFO)

_logger = logging.getLogger("jax_ep")
_failed = threading.Event()
_failure_sources: list[Callable[[], bool]] = []


def note_failure() -> None:
  """Called by a jax_ep host check just before it raises inside a computation."""
  _failed.set()


def add_failure_source(source: Callable[[], bool]) -> None:
  """Registers a check the exit hook consults (e.g. "has an open native group timed out")."""
  _failure_sources.append(source)


def any_failure() -> bool:
  return _failed.is_set() or any(source() for source in _failure_sources)


def settle() -> None:
  """Waits on each of this thread's pending effect tokens; forgets them, logging failures."""
  from jax._src import dispatch  # no public API settles tokens without raising
  tokens = dispatch.runtime_tokens
  for token in [*tokens.current_tokens.values(), *tokens.output_runtime_tokens.values()]:
    try:
      token.block_until_ready()
    except Exception as e:  # noqa: BLE001 - reported to the caller when it happened
      first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
      _logger.warning("jax_ep: dropping the effect token of a computation that failed earlier "
                      "(%s), so that interpreter exit does not re-raise it", first_line[:300])
  tokens.clear()


def _at_exit() -> None:
  try:
    if any_failure():
      settle()
  except Exception:  # noqa: BLE001 - never turn exit into a crash ourselves
    pass


atexit.register(_at_exit)
