"""Bootstrap of the peer transport across processes, with the native extension faked.

Checks the Python wiring that a GPU run relies on: every rank publishes its buffer handle
through the key-value store, every rank connects with all handles in rank order, and close()
waits for every process before freeing. Started by tests/test_multiprocess.py.
"""

import sys
import time

from jax_ep import launch

launch.initialize_from_env()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_ep.backends import transport as transport_lib  # noqa: E402
from jax_ep._native import ffi as _ffi  # noqa: E402
from jax_ep.config import EPConfig  # noqa: E402


class FakeExtension:
  """Stands in for `_jax_ep_ffi`: records what the Python side asks of it."""

  def __init__(self):
    self.calls = []

  def group_create(self, device_ordinal, rank, num_ranks, *rest, **options):
    self.calls.append(("create", rank, num_ranks))
    return 100 + rank

  def group_ipc_handle(self, group_id):
    return f"handle-of-{group_id}".encode()

  def group_connect(self, group_id, handles):
    self.calls.append(("connect", group_id, [bytes(h) for h in handles]))

  def group_error(self, group_id):
    return None

  def group_destroy(self, group_id):
    self.calls.append(("destroy", group_id))


def main():
  fake = FakeExtension()
  _ffi.extension = lambda: fake
  num_ranks, me = jax.process_count(), jax.process_index()
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices())
  config = EPConfig("ep", num_ranks, 4 * num_ranks, 2, 128, 16, np.dtype(np.float32),
                    num_ranks * 16 * 2)
  transport = transport_lib.create_peer(config, mesh, "bootstrap-test", num_sms=4, timeout_s=5.0)
  assert transport.group_ids == [100 + me], transport.group_ids
  want = [f"handle-of-{100 + r}".encode() for r in range(num_ranks)]
  assert fake.calls[:2] == [("create", me, num_ranks), ("connect", 100 + me, want)], fake.calls
  assert transport.error() is None
  transport.close()
  transport.close()  # idempotent
  assert fake.calls[2:] == [("destroy", 100 + me)], fake.calls
  print(f"process {me}: peer bootstrap exchanged {num_ranks} handles in rank order", flush=True)

  # A group over processes 0 and 1 only: they exchange handles between them, and close() waits
  # for those two alone (waiting for every process would sit out the barrier timeout).
  if me < 2:
    fake.calls.clear()
    sub_mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
    sub_config = EPConfig("ep", 2, 8, 2, 128, 16, np.dtype(np.float32), 2 * 16 * 2)
    sub = transport_lib.create_peer(sub_config, sub_mesh, "bootstrap-subset", num_sms=4,
                                    timeout_s=5.0, process_ids=[0, 1])
    want = [f"handle-of-{100 + r}".encode() for r in range(2)]
    assert fake.calls == [("create", me, 2), ("connect", 100 + me, want)], fake.calls
    start = time.monotonic()
    sub.close(barrier_timeout_s=30.0)
    assert time.monotonic() - start < 10.0, "close() waited for a process outside the group"
    print(f"process {me}: subset group closed with its members", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
