"""Checks across the processes of a `jax.distributed` job, through its key-value store.

Group creation uses `check_same_config` so that processes whose configuration differs fail with an
error naming the field, instead of hanging later in a collective or a kernel's spin-wait.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import zlib
from collections.abc import Iterator, Sequence

import jax
from jax._src import distributed as jax_distributed

_KEY_PREFIX = "jax_ep/config"
# Stands for a field that a peer's configuration does not have at all.
_MISSING = "<missing>"

_group_counters: dict[tuple[str, tuple[int, ...] | None], Iterator[int]] = {}
_group_counters_lock = threading.Lock()


def next_group_key(prefix: str, process_ids: Sequence[int] | None = None) -> str:
  """Returns `f"{prefix}-{n}"`, where n counts this process's calls with this prefix from 0.

  Every process creates its groups in the same order, so the n-th group of each process meets
  its peers under the same key. A group over some of the job's processes (`process_ids`) is
  counted apart, per process set, and its key names the set: only its members create it, so it
  must not move the count of the groups that other processes create.
  """
  members = None if process_ids is None else tuple(sorted(process_ids))
  with _group_counters_lock:
    counter = _group_counters.setdefault((prefix, members), itertools.count())
    n = next(counter)
  if members is None:
    return f"{prefix}-{n}"
  if len(members) <= 8:
    tag = ".".join(map(str, members))
  else:
    tag = f"{zlib.crc32(repr(members).encode()):08x}"
  return f"{prefix}-p{tag}-{n}"


def _normalize(fields: dict[str, object]) -> dict[str, object]:
  """The fields as every peer sees them after the JSON round trip (dtypes etc. as `str`)."""
  return json.loads(json.dumps(fields, default=str))


def _is_deadline_error(e: Exception) -> bool:
  # The KV client reports an expired wait as a runtime error whose message carries the gRPC
  # status, e.g. "DEADLINE_EXCEEDED: ..."; there is no dedicated exception type.
  text = str(e).lower()
  return "deadline_exceeded" in text or "deadline exceeded" in text or "timed out" in text


def check_same_config(key: str, fields: dict[str, object], *, timeout_s: float = 60.0,
                      process_ids: Sequence[int] | None = None) -> None:
  """Raises unless every process of the job (or of `process_ids`) passes the same `fields`
  under `key`.

  Each process publishes its fields to the `jax.distributed` key-value store and compares them
  with every peer's, so all processes of a mismatching job raise, not just some. A single-process
  run returns at once.

  Args:
    key: names this check; it must be unique per check within the job (see `next_group_key`)
      and the same on every process.
    fields: the configuration, name -> value. Values that JSON cannot represent (dtypes, ...)
      are compared as `str(value)`.
    timeout_s: how long to wait, in total, for the peers to publish theirs.
    process_ids: the processes that take part (default: all of the job's); this process must be
      one of them.

  Raises:
    ValueError: a field differs between this process and a peer.
    TimeoutError: a peer did not publish its fields within `timeout_s`.
    RuntimeError: the job has several processes but no `jax.distributed` client.
  """
  # NOTES: the process count and index come from the distributed client, not from
  # jax.process_count(): that call creates the backends, which on a multi-process job exchanges
  # topology with every peer and blocks, without our timeout, until all of them have done so.
  state = jax_distributed.global_state
  client = state.client
  if client is None:
    if jax.process_count() == 1:
      return
    raise RuntimeError(
        f"jax_ep.Group: jax.process_count() is {jax.process_count()} but there is no "
        "jax.distributed client to compare the configuration through")
  num_processes, me = state.num_processes, state.process_id
  if num_processes == 1:
    return
  mine = _normalize(fields)
  client.key_value_set_bytes(f"{_KEY_PREFIX}/{key}/{me}", json.dumps(mine).encode())

  deadline = time.monotonic() + timeout_s
  for p in (range(num_processes) if process_ids is None else process_ids):
    if p == me:
      continue
    peer_key = f"{_KEY_PREFIX}/{key}/{p}"
    remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
      blob = client.blocking_key_value_get_bytes(peer_key, remaining_ms)
    except Exception as e:  # The client raises jax.errors.JaxRuntimeError, see above.
      if not _is_deadline_error(e):
        raise
      raise TimeoutError(
          f"jax_ep.Group: process {p} did not publish its configuration within "
          f"{timeout_s:g} s (key {key}, seen from process {me}); did it create the same "
          "groups in the same order?") from e
    theirs = json.loads(blob.decode())
    for name in [*mine, *(n for n in theirs if n not in mine)]:
      mine_value, their_value = mine.get(name, _MISSING), theirs.get(name, _MISSING)
      if mine_value != their_value:
        raise ValueError(
            f"jax_ep.Group: configuration differs between processes: field {name!r} is "
            f"{mine_value!r} on process {me} but {their_value!r} on process {p} "
            f"(key {key})")


def gather_values(key: str, value: str, *, process_ids: Sequence[int], timeout_s: float = 60.0
                  ) -> list[str]:
  """Every process's `value` under `key`, in the order of `process_ids` (this process's
  included); a process that does not publish within `timeout_s` is a TimeoutError."""
  state = jax_distributed.global_state
  client = state.client
  if client is None or len(process_ids) == 1:
    return [value]
  me = state.process_id
  client.key_value_set_bytes(f"jax_ep/gather/{key}/{me}", value.encode())
  deadline = time.monotonic() + timeout_s
  values = []
  for p in process_ids:
    if p == me:
      values.append(value)
      continue
    remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
    try:
      values.append(client.blocking_key_value_get_bytes(f"jax_ep/gather/{key}/{p}",
                                                        remaining_ms).decode())
    except Exception as e:  # noqa: BLE001 - the client reports an expired wait as an error
      if not _is_deadline_error(e):
        raise
      raise TimeoutError(f"jax_ep.Group: process {p} did not publish {key} within "
                         f"{timeout_s:g} s (seen from process {me})") from e
  return values
