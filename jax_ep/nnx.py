"""Flax NNX wrapper of the expert-parallel MoE layer (optional: needs `flax`).

`jax_ep/__init__.py` does not import this module, so jax_ep works without flax. Use::

  from jax_ep.nnx import MoE

  layer = MoE(group, ffn=4 * group.hidden, rngs=nnx.Rngs(0))
  out = layer(x)                        # x: [N, H] or [B, S, H], split over the group's mesh
  loss = task_loss + 1e-2 * layer.aux_loss[...].mean()
  layer.update_bias(rate=1e-3)          # auxiliary-loss-free balancing (with router_bias=True)
"""

from __future__ import annotations

try:
  from flax import nnx
except ImportError as e:  # pragma: no cover - exercised where flax is missing
  raise ImportError("jax_ep.nnx needs flax: pip install 'jax_ep[nnx]' (or pip install "
                    "'flax>=0.12')") from e

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ep.group import Group
from jax_ep.layer import MoEParams, init_moe_params, moe_mlp
from jax_ep.routing import Routing, update_router_bias

# `moe_mlp` under `jit`: inside a traced model this just nests, and an eager call (e.g.
# `layer(x)` at the top level) runs one compiled program instead of op-by-op `shard_map`, which
# is an order of magnitude slower.
_moe_mlp = jax.jit(moe_mlp, static_argnums=(0,), static_argnames=("routing", "mode"))


class MoEStats(nnx.Variable):
  """Statistics of the last call (not a parameter: `nnx.grad` and optimizers skip it)."""


class RouterBias(nnx.Variable):
  """The per-expert selection bias (not a parameter: `update_bias` moves it, not gradients)."""


class MoE(nnx.Module):
  """A mixture-of-experts SwiGLU layer with experts sharded over `group`'s mesh axis.

  The router is replicated; expert `e` lives on rank `e // L` (`L = E / R`). The forward pass is
  `jax_ep.moe_mlp`: routing, dispatch, grouped SwiGLU, weighted combine, plus the shared
  expert when there is one.

  Args:
    group: the `jax_ep.Group`; gives `E` (`num_experts`), `K` (`num_topk`), `H` (`hidden`), the
      mesh and the axis the experts are split over.
    ffn: `F`, the experts' inner size.
    rngs: `nnx.Rngs`; parameters are drawn from `rngs.params()`.
    dtype: expert weight dtype; default the group's activation dtype (must match it for the
      grouped matmuls to run at that precision).
    routing: how tokens pick experts (`jax_ep.Routing`: softmax or sigmoid scores,
      renormalisation, group-limited top-k, a routed scaling factor).
    router_bias: keep a per-expert selection bias (`RouterBias`), moved by `update_bias`.
    shared_ffn: inner size of a shared expert every token goes through (0: none).
    mode: "high_throughput" (training, prefill) or "low_latency" (decode: the low-latency pair,
      experts on its slabs; the group needs `low_latency=True` on the cuda backend).

  Attributes:
    router: `nnx.Param` `[H, E]` float32, replicated (sharding metadata `(None, None)`).
    w_gate, w_up: `nnx.Param` `[E, H, F]`; w_down: `nnx.Param` `[E, F, H]`, in `dtype`, placed
      on the mesh sharded over the EP axis (sharding metadata `(axis_name, None, None)`).
    shared_gate, shared_up, shared_down: the shared expert's `nnx.Param`s, replicated.
    bias: `RouterBias` `[E]` float32 (with `router_bias=True`).
    num_dropped, aux_loss, z_loss: `MoEStats` `[M]`, one entry per shard of tokens, of the
      most recent call (`jax_ep.MoEOutput`); expert_counts: `MoEStats` `[M, E]` int32.
  """

  def __init__(self, group: Group, *, ffn: int, rngs: nnx.Rngs, dtype=None,
               routing: Routing = Routing(), router_bias: bool = False, shared_ffn: int = 0,
               mode: str = "high_throughput"):
    if mode not in ("high_throughput", "low_latency"):
      raise ValueError(f"jax_ep.nnx.MoE: mode must be 'high_throughput' or 'low_latency', got "
                       f"{mode!r}")
    self.group = group
    self.routing = routing
    self.mode = mode
    dtype = group.dtype if dtype is None else dtype
    params = init_moe_params(rngs.params(), num_experts=group.num_experts, hidden=group.hidden,
                             ffn=ffn, dtype=dtype, shared_ffn=shared_ffn,
                             router_bias=router_bias)
    axis = group.axis_name
    mesh = group.mesh

    def param(value, names, kind=nnx.Param):
      value = jax.device_put(value, NamedSharding(mesh, P(*names)))
      # Already placed above; the metadata records the layout for nnx.get_partition_spec & co.
      return kind(value, out_sharding=names, mesh=mesh, eager_sharding=False)

    self.router = param(params.router, (None, None))
    self.w_gate = param(params.w_gate, (axis, None, None))
    self.w_up = param(params.w_up, (axis, None, None))
    self.w_down = param(params.w_down, (axis, None, None))
    self.bias = param(params.router_bias, (None,), RouterBias) if router_bias else None
    shared = lambda value: param(value, (None, None)) if shared_ffn else None
    self.shared_gate = shared(params.shared_gate)
    self.shared_up = shared(params.shared_up)
    self.shared_down = shared(params.shared_down)
    num_shards = group.mesh.devices.size
    self.num_dropped = MoEStats(jnp.zeros((num_shards,), jnp.int32))
    self.aux_loss = MoEStats(jnp.zeros((num_shards,), jnp.float32))
    self.z_loss = MoEStats(jnp.zeros((num_shards,), jnp.float32))
    self.expert_counts = MoEStats(jnp.zeros((num_shards, group.num_experts), jnp.int32))

  @property
  def params(self) -> MoEParams:
    """The current weights as a `jax_ep.MoEParams` (global arrays)."""
    value = lambda v: None if v is None else v[...]
    return MoEParams(self.router[...], self.w_gate[...], self.w_up[...], self.w_down[...],
                     value(self.bias), value(self.shared_gate), value(self.shared_up),
                     value(self.shared_down))

  def __call__(self, x, topk_idx=None, topk_weights=None):
    """Applies the layer.

    Args:
      x: `[N, H]` or `[B, S, H]` activations in the group's dtype, split evenly over the
        group's mesh (`N / M <= max_tokens_per_rank` tokens per shard).
      topk_idx, topk_weights: optional routing shaped like `x` with `K` for `H`; by default
        the router decides.

    Returns:
      The layer's output, shaped like `x`. The statistics go to the `MoEStats` attributes.
    """
    result = _moe_mlp(self.group, self.params, x, topk_idx, topk_weights,
                      routing=self.routing, mode=self.mode)
    self.num_dropped.set_value(result.num_dropped)
    self.aux_loss.set_value(result.aux_loss)
    self.z_loss.set_value(result.z_loss)
    self.expert_counts.set_value(result.expert_counts)
    return result.out

  def update_bias(self, rate: float = 1e-3) -> None:
    """Moves the selection bias towards balance from the last call's `expert_counts`
    (`jax_ep.update_router_bias`; DeepSeek-V3's auxiliary-loss-free balancing)."""
    if self.bias is None:
      raise ValueError("jax_ep.nnx.MoE.update_bias: the layer was created without "
                       "router_bias=True")
    self.bias.set_value(update_router_bias(self.bias[...], self.expert_counts[...], rate))
