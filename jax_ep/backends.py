"""Backends: the per-shard operations every backend provides, behind one small interface.

`primitives.py` builds the differentiable ops (custom_vjp) on top of this interface only, so the
gradient rules are written once and verified on the CPU through the reference backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import reference
from jax_ep.config import EPConfig


@dataclasses.dataclass(frozen=True)
class ReferenceBackend:
  """Pure JAX; runs on every platform. The oracle-checked baseline for all other backends."""
  config: EPConfig
  name = "reference"

  def layout(self, topk_idx):
    return reference.layout(self.config, topk_idx)

  def dispatch(self, x, routing, slot_weights=None):
    return reference.dispatch(self.config, x, routing, slot_weights)

  def combine(self, expert_out, routing, slot_weights=None):
    return reference.combine(self.config, expert_out, routing, slot_weights)

  def combine_vjp(self, d_out, expert_out, routing, slot_weights):
    return reference.combine_vjp(self.config, d_out, expert_out, routing, slot_weights)

  def low_latency_dispatch(self, x, topk_idx, use_fp8):
    return reference.low_latency_dispatch(self.config, x, topk_idx, use_fp8)

  def low_latency_combine(self, expert_out, routing, topk_weights):
    return reference.low_latency_combine(self.config, expert_out, routing, topk_weights)

  def workspace_bytes(self) -> int:
    return reference.scratch_bytes(self.config)


@dataclasses.dataclass(frozen=True)
class CudaBackend:
  """CUDA kernels through XLA FFI custom calls.

  At one rank (`R == 1`) dispatch and combine are purely local (layout, permute, unpermute);
  the multi-rank peer transport is not built yet, so `R > 1` is refused when the group is made.
  The low-latency pair has no kernels yet and runs on the reference path (same semantics).
  """
  config: EPConfig
  name = "cuda"

  def __post_init__(self):
    if self.config.num_ranks != 1:
      raise NotImplementedError(
          f"jax_ep.Group(backend='cuda'): the cuda backend runs at one rank for now "
          f"(num_ranks=1); got num_ranks={self.config.num_ranks}. Use backend='reference' "
          f"(or 'auto') for multi-rank groups until the peer transport lands.")

  def layout(self, topk_idx):
    from jax_ep import cuda_ops
    return cuda_ops.local_layout(self.config, topk_idx)

  def dispatch(self, x, routing, slot_weights=None):
    from jax_ep import cuda_ops
    return cuda_ops.local_permute(self.config, x, routing, slot_weights)

  def combine(self, expert_out, routing, slot_weights=None):
    from jax_ep import cuda_ops
    return cuda_ops.local_unpermute(self.config, expert_out, routing, slot_weights)

  def combine_vjp(self, d_out, expert_out, routing, slot_weights):
    from jax_ep import cuda_ops
    d_expert_out = cuda_ops.local_permute(self.config, d_out, routing, slot_weights)
    return d_expert_out, cuda_ops.local_slot_dots(self.config, d_out, expert_out, routing)

  def low_latency_dispatch(self, x, topk_idx, use_fp8):
    return reference.low_latency_dispatch(self.config, x, topk_idx, use_fp8)

  def low_latency_combine(self, expert_out, routing, topk_weights):
    return reference.low_latency_combine(self.config, expert_out, routing, topk_weights)

  def workspace_bytes(self) -> int:
    from jax_ep import cuda_ops
    return cuda_ops.layout_workspace_bytes(self.config)


BACKENDS = {"reference": ReferenceBackend, "cuda": CudaBackend}
