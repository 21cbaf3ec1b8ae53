"""How a group's run-time failures reach the host without a host synchronisation per op.

A multi-rank cuda kernel that gives up waiting for a peer writes an error record into
host-mapped memory (the intranode group's mailbox) and every later kernel of the group returns at
once; the host reads that record with a plain load, no stream sync. A strict group's dropped
rows are recorded by the dispatch itself (see `jax_ep.ops`). `GroupStatus` holds the first
failure of one group; one watchdog thread per process polls the open groups' error records and
logs a failure through the `jax_ep` logger as soon as it appears. `Group.check()`, `close()` and
the next op traced on the group raise it (and the next intranode op's handler fails with the same
text, so a cached program raises too).
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
    # Strict-mode drops: calls seen per rank, and the ranks that dropped in the failing call.
    self._strict_calls: dict[int, int] = {}
    self._drop_call: int | None = None
    self._drops: dict[int, tuple[int, int]] = {}
    self._capacity = 0

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

  def strict_dispatch(self, rank: int, num_dropped: int, capacity: int) -> None:
    """Called on the host for every dispatch of a strict group, once per rank.

    Records the rows `rank` dropped and logs them; raises `CapacityOverflowError` in a call
    after the one that dropped, so that a cached program fails at its next dispatch.
    NOTES: every rank issues the same dispatches in the same order, so the n-th call of one
    rank is the n-th of every other: the call number tells "another rank of the failing call"
    (which must not raise) from "a later call".
    """
    with self._lock:
      call = self._strict_calls.get(rank, 0) + 1
      self._strict_calls[rank] = call
      if self._drop_call is not None and call > self._drop_call:
        self._raised = True
        raise CapacityOverflowError(self._drop_message())
      if num_dropped <= 0:
        return
      self._drop_call = call
      self._drops[rank] = (int(num_dropped), int(capacity) + int(num_dropped))
      self._capacity = int(capacity)
    _logger.error("jax_ep.dispatch (strict): rank %d dropped %d rows in call %d of %s: "
                  "capacity=%d, a capacity of at least %d would fit them", rank,
                  int(num_dropped), call, self.name, int(capacity),
                  int(capacity) + int(num_dropped))

  def _drop_message(self) -> str:
    ranks = sorted(self._drops)
    per_rank = ", ".join(f"rank {r}: {self._drops[r][0]} rows" for r in ranks)
    need = max(self._drops[r][1] for r in ranks)
    return (f"jax_ep.dispatch: call {self._drop_call} of {self.name} dropped rows that did not "
            f"fit in capacity={self._capacity} ({per_rank}); a capacity of at least {need} "
            f"would fit them. The group was created with strict=True: raise capacity, or pass "
            f"strict=False to count drops in num_dropped instead")

  # ------------------------------------------------------------------ reporting
  def failure(self) -> tuple[str, type[Exception]] | None:
    """The first failure as `(message, exception type)`, or None; polls the record first.

    A timeout leaves the group unusable, so it is reported before any dropped rows."""
    self.poll()
    with self._lock:
      if self._message is not None:
        return self._message, TimeoutError
      if self._drop_call is not None:
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
