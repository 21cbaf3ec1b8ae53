"""The interface every backend implements: the per-shard operations of both modes.

`jax_ep/backends/primitives.py` builds the differentiable ops (custom_vjp) on this interface
alone, so the gradient rules are written once and verified on the CPU through the reference
backend. A backend is a frozen dataclass (hashable: the primitives take it as a static argument)
holding its group's `EPConfig` and, on the cuda backend, the ids of the native groups its
handlers look up. Every method is a per-shard function, called inside `shard_map` over
`config.axis_name`; `layout` is the backend's own metadata (a pytree of arrays: where
dispatch put each row) that it hands back to itself. `topk_weights` is always the router's
`[T, K]` float32 weights of this rank's tokens (docs/DESIGN.md section 1, "Names across the
layers").

Shapes: `T` tokens on this rank, `K` top-k, `H` hidden, `C` capacity, `L` local experts, `R`
ranks, `T_max` max tokens per rank.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

from jax_ep.config import EPConfig, RowFormat


class HighThroughputBackend(Protocol):
  """The high-throughput pair (`jax_ep.dispatch` / `jax_ep.combine`) of one group: what a
  backend over one host's ranks gives `jax_ep.backends.hierarchical.Hierarchy` too."""

  config: EPConfig

  def dispatch(self, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, Any]:
    """Dispatch with its layout: `x` `[T, H]`, `topk_idx` `[T, K]` int32 (slots of one token
    already merged), `topk_weights` `[T, K]` float32 -> `(recv_x [C, H], group_sizes [L] int32,
    num_dropped [] int32, num_invalid [] int32, layout)`."""

  def dispatch_fp8(self, x: jax.Array, x_scales: jax.Array | None, topk_idx: jax.Array,
                   topk_weights: jax.Array) -> tuple:
    """Dispatch in the group's fp8 `config.wire_format`: `x` `[T, H]` in the activations'
    dtype (quantised here, once per token, `x_scales` None) or float8_e4m3fn rows with their
    `x_scales` (`[T, H/128]` float32, `[T, H/512]` int32 for UE8M0) -> `(recv_x [C, H]
    float8_e4m3fn, recv_scales [C, H/128] or [C, H/512], group_sizes, num_dropped,
    num_invalid, layout)`; the layout is `dispatch`'s (combine takes it). Only backends whose
    registry entry accepts an fp8 `wire_format` implement it."""

  def dispatch_cached(self, x: jax.Array, layout: Any, topk_weights: jax.Array | None = None
                      ) -> jax.Array:
    """`x` `[T, H]` placed as an earlier dispatch placed its rows (`layout`): `[C, H]`; with
    `topk_weights` `[T, K]` each row scaled by its slot's weight (the weighted combine's
    transpose)."""

  def combine(self, expert_out: jax.Array, layout: Any, topk_weights: jax.Array | None = None
              ) -> jax.Array:
    """`expert_out` `[C, H]` home: `[T, H]`, each token's rows summed in fp32, weighted by
    `topk_weights` `[T, K]` when given."""

  def combine_vjp(self, d_out: jax.Array, expert_out: jax.Array, layout: Any,
                  topk_weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cotangents of the weighted combine: `(d_expert_out [C, H], d_topk_weights [T, K]
    float32)`."""


class Backend(HighThroughputBackend, Protocol):
  """A group's backend: both modes' per-shard operations.

  The low-latency pair (`jax_ep.low_latency_dispatch` / `_combine`, and their split forms)
  takes the dispatch's `row_format` (`jax_ep.RowFormat`).
  """

  name: str  # 'reference' or 'cuda', as `jax_ep.Group(backend=...)` names it
  # Whether the low-latency pair runs kernels: then primitives.py gives it its gradients (and
  # asks for the dispatch's `topk_weights` and the combine's `gather`, which only such
  # backends take); else JAX differentiates the pair as written.
  low_latency_kernels: bool

  def low_latency_dispatch(self, x: jax.Array, topk_idx: jax.Array, row_format: RowFormat,
                           topk_weights: jax.Array | None = None) -> tuple:
    """`(recv_x [L, R*T_max, H], scales or None, count [L], num_dropped, num_invalid,
    layout)`; with `topk_weights` `[T, K]` float32 the row sent for each slot is scaled by its
    weight (the weighted combine's transpose; PLAIN rows only)."""

  def low_latency_combine(self, expert_out: jax.Array, layout: Any,
                          topk_weights: jax.Array | None, gather: bool = False) -> jax.Array:
    """`expert_out` `[L, R*T_max, H]` -> `[T, H]` weighted by `topk_weights` `[T, K]` float32;
    with `gather`, each slot's row unreduced: `[T, K, H]`."""

  def low_latency_dispatch_send(self, x: jax.Array, topk_idx: jax.Array,
                                row_format: RowFormat) -> Any:
    """The send half of `low_latency_dispatch`: what the wait takes."""

  def low_latency_dispatch_wait(self, sent: Any, topk_idx: jax.Array, x_dtype: np.dtype,
                                row_format: RowFormat) -> tuple:
    """What `low_latency_dispatch` returns, for the rows `sent` sent."""

  def low_latency_combine_send(self, expert_out: jax.Array, layout: Any) -> Any:
    """The send half of `low_latency_combine`: what the wait takes."""

  def low_latency_combine_wait(self, sent: Any, layout: Any, topk_weights: jax.Array,
                               dtype: np.dtype) -> jax.Array:
    """`[T, H]` in `dtype`: the rows `sent` sent, reduced with `topk_weights`."""


class LayoutThenDispatch:
  """`dispatch` of backends whose layout is computable before any row moves (the reference,
  the one-rank cuda backend): `layout(topk_idx)`, then `dispatch_cached` along it."""

  def dispatch(self, x, topk_idx, topk_weights):
    del topk_weights  # travels with the handle; combine sends what it needs
    layout, group_sizes, num_dropped, num_invalid = self.layout(topk_idx)
    return self.dispatch_cached(x, layout), group_sizes, num_dropped, num_invalid, layout
