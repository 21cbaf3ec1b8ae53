"""Flax NNX wrapper of the expert-parallel MoE layer (optional: needs `flax`).

`jax_ep/__init__.py` does not import this module, so jax_ep works without flax. Use::

  from jax_ep.nnx import MoE

  layer = MoE(group, ffn=4 * group.hidden, rngs=nnx.Rngs(0))
  out = layer(x)                    # x: [R * T, H], split over the group's axis
  dropped = layer.num_dropped[...]  # [R] int32, rows each rank dropped in the last call
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_ep.group import Group
from jax_ep.layer import MoEParams, init_moe_params, moe_mlp


# `moe_mlp` under `jit`: inside a traced model this just nests, and an eager call (e.g.
# `layer(x)` at the top level) runs one compiled program instead of op-by-op `shard_map`, which
# is an order of magnitude slower.
_moe_mlp = jax.jit(moe_mlp, static_argnums=(0,))


class MoEStats(nnx.Variable):
  """Statistics of the last call (not a parameter: `nnx.grad` and optimizers skip it)."""


class MoE(nnx.Module):
  """A mixture-of-experts SwiGLU layer with experts sharded over `group`'s mesh axis.

  The router is replicated; expert `e` lives on rank `e // L` (`L = E / R`). The forward pass is
  `jax_ep.moe_mlp`: softmax top-k routing, dispatch, grouped SwiGLU, weighted combine.

  Args:
    group: the `jax_ep.Group`; gives `E` (`num_experts`), `K` (`num_topk`), `H` (`hidden`), the
      mesh and the axis the experts are split over.
    ffn: `F`, the experts' inner size.
    rngs: `nnx.Rngs`; parameters are drawn from `rngs.params()`.
    dtype: expert weight dtype; default the group's activation dtype (must match it for the
      ragged matmuls to run at that precision).

  Attributes:
    router: `nnx.Param` `[H, E]` float32, replicated (sharding metadata `(None, None)`).
    w_gate, w_up: `nnx.Param` `[E, H, F]`; w_down: `nnx.Param` `[E, F, H]`, in `dtype`, placed
      on the mesh sharded over the EP axis (sharding metadata `(axis_name, None, None)`).
    num_dropped: `MoEStats` `[R]` int32, rows each rank dropped in the most recent call (always 0
      with the group's default capacity). Updated by `__call__`; read it with `num_dropped[...]`.
  """

  def __init__(self, group: Group, *, ffn: int, rngs: nnx.Rngs, dtype=None):
    self.group = group
    dtype = group.dtype if dtype is None else dtype
    params = init_moe_params(rngs.params(), num_experts=group.num_experts, hidden=group.hidden,
                             ffn=ffn, dtype=dtype)
    axis = group.axis_name
    mesh = group.mesh

    def param(value, names):
      value = jax.device_put(value, NamedSharding(mesh, P(*names)))
      # Already placed above; the metadata records the layout for nnx.get_partition_spec & co.
      return nnx.Param(value, out_sharding=names, mesh=mesh, eager_sharding=False)

    self.router = param(params.router, (None, None))
    self.w_gate = param(params.w_gate, (axis, None, None))
    self.w_up = param(params.w_up, (axis, None, None))
    self.w_down = param(params.w_down, (axis, None, None))
    self.num_dropped = MoEStats(jnp.zeros((group.num_ranks,), jnp.int32))

  @property
  def params(self) -> MoEParams:
    """The current weights as a `jax_ep.MoEParams` (global arrays)."""
    return MoEParams(self.router[...], self.w_gate[...], self.w_up[...], self.w_down[...])

  def __call__(self, x, topk_idx=None, topk_weights=None):
    """Applies the layer.

    Args:
      x: `[R * T, H]` activations in the group's dtype, split evenly over the EP axis
        (data-parallel layout), `T <= max_tokens_per_rank`.
      topk_idx, topk_weights: optional `[R * T, K]` int32 / float32 routing; by default the
        router decides.

    Returns:
      `[R * T, H]` in `x.dtype`. The per-rank dropped-row counts go to `self.num_dropped`.
    """
    out, num_dropped = _moe_mlp(self.group, self.params, x, topk_idx, topk_weights)
    self.num_dropped.set_value(num_dropped)
    return out
