"""jax_ep: expert-parallel dispatch and combine for JAX mixture-of-experts models.

The contract is docs/DESIGN.md. Quick start::

  group = jax_ep.Group(mesh, "ep", num_experts=256, num_topk=8, hidden=7168,
                       max_tokens_per_rank=4096)
  def layer(x, topk_idx, topk_weights):          # inside jax.shard_map over "ep"
    recv, handle = jax_ep.dispatch(group, x, topk_idx, topk_weights)
    y = expert_mlp(recv.x, recv.group_sizes)     # e.g. jax.lax.ragged_dot
    return jax_ep.combine(group, y, handle)

The modules here are the public API; the layers under it are folders (backends/, kernels/,
_native/, launch/), each importing only the ones below it (docs/layout.md).
"""

from jax_ep._native import ffi as _ffi
from jax_ep._status import CapacityOverflowError
from jax_ep.config import RowFormat, default_capacity
from jax_ep.group import Group
from jax_ep.sizing import MemoryEstimate, capacity_from_buffer_factor, memory_bytes
from jax_ep.gmm import grouped_matmul, grouped_matmul_impl
from jax_ep.experts.fp8 import Fp8Weights, grouped_matmul_fp8, quantize_weights
from jax_ep.mlp import expert_mlp, expert_mlp_slabs
from jax_ep.layer import (MoEOutput, MoEParams, init_moe_params,
                          moe_mlp, moe_mlp_per_shard)
from jax_ep.routing import (Routing, expert_capacity, expert_counts, limit_expert_capacity,
                            load_balancing_loss, route, router_z_loss, update_router_bias)
from jax_ep.ops import (DispatchResult, Handle, combine, dequantize, dispatch, quantize,
                        zero_padding)
from jax_ep.low_latency import (LowLatencyHandle, LowLatencyResult, LowLatencySent,
                                low_latency_combine, low_latency_combine_send,
                                low_latency_combine_wait, low_latency_dispatch,
                                low_latency_dispatch_send, low_latency_dispatch_wait)

__version__ = "0.1.0"

# Register the CUDA custom calls with XLA now (no CUDA call is made; a no-op without the
# extension), so programs that reach them through jax.export or other entry points find them.
_ffi.extension()

__all__ = [
    "Group", "CapacityOverflowError", "MemoryEstimate", "memory_bytes", "default_capacity",
    "capacity_from_buffer_factor",
    "dispatch", "combine", "quantize", "dequantize", "low_latency_dispatch", "low_latency_combine",
    "low_latency_dispatch_send", "low_latency_dispatch_wait", "low_latency_combine_send",
    "low_latency_combine_wait", "LowLatencySent", "RowFormat",
    "grouped_matmul", "grouped_matmul_impl", "grouped_matmul_fp8", "Fp8Weights",
    "quantize_weights", "expert_mlp", "expert_mlp_slabs",
    "DispatchResult", "Handle", "zero_padding", "LowLatencyResult", "LowLatencyHandle",
    "MoEOutput", "MoEParams", "init_moe_params", "moe_mlp", "moe_mlp_per_shard",
    "Routing", "route", "expert_counts", "limit_expert_capacity", "expert_capacity",
    "load_balancing_loss", "router_z_loss",
    "update_router_bias",
]
