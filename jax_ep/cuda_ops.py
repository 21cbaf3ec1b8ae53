"""`ffi_call` wrappers for the CUDA kernels (primitive layer of the cuda backend).

Each function states the abstract shapes of its custom call; leading batch dimensions from
`jax.vmap` are passed to the kernels as-is (`vmap_method="broadcast_all"`), which run every batch
element in one launch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _ffi
from jax_ep.config import EPConfig


class LocalRouting(NamedTuple):
  """Routing metadata of the one-rank cuda path (int32).

  Attributes:
    slot_row: `[T, K]` row of `recv_x` holding each slot, -1 if it selects nothing or was dropped.
    group_sizes: `[E]` kept rows per expert (the kernels zero rows past their sum).
  """
  slot_row: jax.Array
  group_sizes: jax.Array


def _varying_axes(value) -> frozenset:
  manual = getattr(jax.typeof(value), "manual_axis_type", None)
  return manual.varying if manual is not None else frozenset()


def _call(target, result_shapes, *args, **attrs):
  """`ffi_call` whose results vary over the same shard_map axes as its operands.

  NOTES: XLA FFI calls produce values typed as invariant across `shard_map` axes; inside
  `shard_map(check_vma=True)` the custom_vjp rules then see cotangents whose type differs from
  the primal's. A kernel's output depends on its (per-rank) inputs, so it varies wherever they do.
  """
  if _ffi.extension() is None:
    raise RuntimeError(f"jax_ep: the CUDA extension is not built; cannot call {target}")
  outs = jax.ffi.ffi_call(target, result_shapes, vmap_method="broadcast_all")(*args, **attrs)
  varying = frozenset().union(*(_varying_axes(a) for a in args))

  def match(out):
    missing = tuple(sorted(varying - _varying_axes(out)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out
  return jax.tree.map(match, outs)


def layout_workspace_elems(config: EPConfig, num_tokens: int) -> int:
  ext = _ffi.extension()
  return int(ext.local_layout_workspace_elems(num_tokens, config.num_topk, config.num_experts))


def layout_workspace_bytes(config: EPConfig) -> int:
  if _ffi.extension() is None:
    return 0
  return 4 * layout_workspace_elems(config, config.max_tokens_per_rank)


def local_layout(config: EPConfig, topk_idx: jax.Array):
  num_tokens, num_topk = topk_idx.shape
  i32 = jnp.int32
  shapes = (jax.ShapeDtypeStruct((num_tokens, num_topk), i32),           # slot_row
            jax.ShapeDtypeStruct((config.num_experts,), i32),             # group_sizes
            jax.ShapeDtypeStruct((), i32),                                # num_dropped
            jax.ShapeDtypeStruct((), i32),                                # num_invalid
            jax.ShapeDtypeStruct((layout_workspace_elems(config, num_tokens),), i32))
  slot_row, group_sizes, num_dropped, num_invalid, _ = _call(
      "jax_ep_local_layout", shapes, topk_idx.astype(i32),
      num_experts=np.int64(config.num_experts), capacity=np.int64(config.capacity))
  return LocalRouting(slot_row, group_sizes), group_sizes, num_dropped, num_invalid


def _weights_or_placeholder(routing: LocalRouting, slot_weights):
  if slot_weights is not None:
    return slot_weights.astype(jnp.float32), True
  # Not read by the kernels when weighted=False; the operand list is fixed per target.
  return jnp.zeros(routing.slot_row.shape, jnp.float32), False


def local_permute(config: EPConfig, x: jax.Array, routing: LocalRouting, slot_weights=None):
  weights, weighted = _weights_or_placeholder(routing, slot_weights)
  shape = jax.ShapeDtypeStruct((config.capacity, x.shape[-1]), x.dtype)
  return _call("jax_ep_local_permute", shape, x, routing.slot_row, routing.group_sizes, weights,
               capacity=np.int64(config.capacity), weighted=weighted)


def local_unpermute(config: EPConfig, expert_out: jax.Array, routing: LocalRouting,
                    slot_weights=None):
  weights, weighted = _weights_or_placeholder(routing, slot_weights)
  num_tokens = routing.slot_row.shape[0]
  shape = jax.ShapeDtypeStruct((num_tokens, expert_out.shape[-1]), expert_out.dtype)
  return _call("jax_ep_local_unpermute", shape, expert_out, routing.slot_row, weights,
               weighted=weighted)


def local_slot_dots(config: EPConfig, d_out: jax.Array, expert_out: jax.Array,
                    routing: LocalRouting):
  shape = jax.ShapeDtypeStruct(routing.slot_row.shape, jnp.float32)
  return _call("jax_ep_local_slot_dots", shape, d_out.astype(expert_out.dtype), expert_out,
               routing.slot_row)
