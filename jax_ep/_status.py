"""How a group's run-time failures reach the host without a host synchronisation per op.

A multi-rank cuda kernel that gives up waiting for a peer writes an error record into
host-mapped memory (the group's mailbox) and every later kernel of the group returns at
once; the host reads that record with a plain load, no stream sync. A strict group's dropped
rows are recorded by the dispatch itself (see `jax_ep.ops`). `GroupStatus` holds the first
failure of one group; one watchdog thread per process polls the open groups' error records and
logs a failure through the `jax_ep` logger as soon as it appears. `Group.check()`, `close()` and
the next op traced on the group raise it; after a timeout the next peer op's handler fails
with the same text too, so a compiled program raises as well.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable

_logger = logging.getLogger("jax_ep")


class CapacityOverflowError(RuntimeError):
  """A dispatch of a `strict=True` group dropped rows (they did not fit in `capacity`)."""


class GroupStatus:
  """The first failure of one group, where it came from, and whether the user has seen it.

  Args:
    name: how messages name the group (its repr).
    poll: reads the native error record without synchronising; returns its message or None.
      None for groups without one (reference backend, one rank).
  """

  def __init__(self, name: str, poll: Callable[[], str | None] | None = None):
    self.name = name
    self._poll = poll
    self._lock = threading.Lock()
    self._poll_lock = threading.Lock()
    self._message: str | None = None  # the first timeout
    self._raised = False
    self._closed = False
    # Strict-mode drops: per shard, (rows dropped, the capacity that would fit them).
    self._drops: dict[str, tuple[int, int]] = {}
    self._capacity = 0
    self._padding = 0

  # ------------------------------------------------------------------ recording
  def record(self, message: str) -> bool:
    """Keeps a timeout's `message` if it is the group's first, logging it; True if it was."""
    with self._lock:
      if self._message is not None:
        return False
      self._message = message
    _logger.error("%s", message)
    return True

  def poll(self) -> None:
    """Reads the native error record once (no device sync) and records what it says."""
    # NOTES: the read happens under `_poll_lock`, which `close()` takes too: once close()
    # returns, no thread still reads the record that the group is about to free.
    with self._poll_lock:
      if self._poll is None or self._closed:
        return
      with self._lock:
        if self._message is not None:
          return
      message = self._poll()
    if message:
      self.record(message)

  def strict_dispatch(self, shard: str, num_dropped: int, capacity: int,
                      padding: int = 0) -> None:
    """Called on the host by every dispatch of a strict group, once per shard (`shard` names
    it: its EP rank, and its other mesh coordinates where there are any). `padding`: the most
    rows the group's `expert_alignment` adds between experts (`L * (A - 1)`), which the
    capacity that would fit the dropped rows includes.

    Records the rows the shard dropped (the first drop of each shard is logged at once); the
    dispatch itself completes. NOTES: it never raises: a callback may run several times for
    one dispatch (once per batch element under vmap, again when remat recomputes the forward
    pass), so no count of callbacks can tell the call that dropped from a later one.
    """
    if num_dropped <= 0:
      return
    need = int(capacity) + int(num_dropped) + int(padding)
    with self._lock:
      first = shard not in self._drops
      self._drops[shard] = (int(num_dropped), need)
      self._capacity = int(capacity)
      self._padding = int(padding)
    if first:
      _logger.error("jax_ep.dispatch (strict): %s dropped %d rows in %s: capacity=%d, %s",
                    shard, int(num_dropped), self.name, int(capacity),
                    self._would_fit(need))

  def _drop_message(self) -> str:
    shards = sorted(self._drops)
    per_shard = ", ".join(f"{s}: {self._drops[s][0]} rows" for s in shards)
    need = max(self._drops[s][1] for s in shards)
    return (f"jax_ep.dispatch: {self.name} dropped rows that did not fit in "
            f"capacity={self._capacity} ({per_shard}, in the last dispatch that dropped); "
            f"{self._would_fit(need)}. The group was created with "
            f"strict=True: raise capacity, or pass strict=False to count drops in num_dropped "
            f"instead")

  def _would_fit(self, need: int) -> str:
    if not self._padding:
      return f"a capacity of at least {need} would fit them"
    return (f"a capacity of {need} would fit them (with the {self._padding} rows of padding "
            f"expert_alignment can add)")

  # ------------------------------------------------------------------ reporting
  def failure(self) -> tuple[str, type[Exception]] | None:
    """The first failure as `(message, exception type)`, or None; polls the record first.

    A timeout leaves the group unusable, so it is reported before any dropped rows."""
    self.poll()
    with self._lock:
      if self._message is not None:
        return self._message, TimeoutError
      if self._drops:
        return self._drop_message(), CapacityOverflowError
      return None

  def raise_if_failed(self) -> None:
    failure = self.failure()
    if failure is not None:
      with self._lock:
        self._raised = True
      message, error_type = failure
      raise error_type(message)

  @property
  def raised(self) -> bool:
    """Whether the failure has been raised to the user already."""
    with self._lock:
      return self._raised

  def close(self) -> None:
    """Stops polling (the native record is about to be freed); waits for a read under way."""
    with self._poll_lock:
      self._closed = True


class _Watchdog:
  """One daemon thread per process polling every open group's error record."""

  def __init__(self, interval_s: float = 0.1):
    self.interval_s = interval_s
    self._statuses: weakref.WeakSet[GroupStatus] = weakref.WeakSet()
    self._lock = threading.Lock()
    self._wake = threading.Event()
    self._thread: threading.Thread | None = None

  def watch(self, status: GroupStatus) -> None:
    with self._lock:
      self._statuses.add(status)
      if self._thread is None or not self._thread.is_alive():
        self._thread = threading.Thread(target=self._run, name="jax_ep-watchdog", daemon=True)
        self._thread.start()

  def unwatch(self, status: GroupStatus) -> None:
    with self._lock:
      self._statuses.discard(status)

  def poll_once(self) -> None:
    with self._lock:
      statuses = list(self._statuses)
    for status in statuses:
      try:
        status.poll()
      except Exception:  # noqa: BLE001 - a group freed under us; the next turn skips it
        pass

  def _run(self) -> None:
    while True:
      self._wake.wait(self.interval_s)
      self._wake.clear()
      self.poll_once()


WATCHDOG = _Watchdog()
