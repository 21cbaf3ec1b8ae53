"""What the cuda backend's ops on jax_ep's own stream and the layer's pipeline share.

An op on jax_ep's own stream is two custom calls: `<op>_own_stream` (the op, launched on a
stream jax_ep owns after the work XLA queued before it) and `jax_ep_join` (XLA's stream waits
for it; ffi/runtime/side_stream.h). Both carry a key: the join waits for the latest op of its
key, so the ops of one micro-batch can be joined while another's still run. Plain calls take
key 0; the pipeline (jax_ep/overlap.py) gives each micro-batch its own.
"""

from __future__ import annotations

import logging
import os

SUFFIX = "_own_stream"
JOIN = "jax_ep_join"

# `0`: jax_ep's own stream runs on every SM (a plain stream of the greatest priority) instead of
# a partition of the group's SMs: a comparison's baseline.
ENV_PARTITION = "JAX_EP_OWN_STREAM_PARTITION"

_logger = logging.getLogger("jax_ep")
_SAID: set[tuple[int, int, str]] = set()


def partition_sms(num_sms: int) -> int:
  """The SMs of the green context to ask jax_ep's own stream to run on (0: none), for a group
  of budget `num_sms`: the budget, but where `JAX_EP_OWN_STREAM_PARTITION=0` and where the
  processes share one GPU (`python -m jax_ep.launch --share-gpu`), whose partitions would all
  name the same SMs while their kernels must be resident together."""
  from jax_ep.launch.env import ENV_SHARED_GPU
  if os.environ.get(ENV_SHARED_GPU) == "1" or os.environ.get(ENV_PARTITION) == "0":
    return 0
  return num_sms


def prepare(extension, device: int, num_sms: int) -> int:
  """Makes `device`'s own stream (once per process: the first group's settings decide) and
  returns the SMs of its partition (0: a plain stream); logs once where one was asked for and
  none was made, and why."""
  asked = partition_sms(num_sms)
  got, why_not = extension.prepare_own_stream(device, asked)
  if asked and not got and (device, asked, why_not) not in _SAID:
    _SAID.add((device, asked, why_not))
    _logger.info("jax_ep's own stream on device %d runs on every SM, not a partition of %d: "
                 "%s", device, asked, why_not)
  return int(got)
