"""What the cuda backend's ops on jax_ep's own stream and the layer's pipeline share.

An op on jax_ep's own stream is two custom calls: `<op>_own_stream` (the op, launched on a
stream jax_ep owns after the work XLA queued before it) and `jax_ep_join` (XLA's stream waits
for it; ffi/runtime/side_stream.h). Both carry a key: the join waits for the latest op of its
key, so the ops of one micro-batch can be joined while another's still run. Plain calls take
key 0; the pipeline (jax_ep/overlap.py) gives each micro-batch its own.
"""

from __future__ import annotations

SUFFIX = "_own_stream"
JOIN = "jax_ep_join"
