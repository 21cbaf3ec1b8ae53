"""Flax NNX wrapper of the expert-parallel MoE layer (optional: needs `flax`).

`jax_ep/__init__.py` does not import this module, so jax_ep works without flax. Use::

  from jax_ep.nnx import MoE

  layer = MoE(group, ffn=4 * group.hidden, rngs=nnx.Rngs(0))   # float32 weights, the
  out = layer(x)                        # group's dtype in the experts; x: [N, H] or [B, S, H]
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
from jax_ep.layer import MoEOutput, MoEParams, _check_options, init_moe_params, moe_mlp
from jax_ep.routing import Routing, update_router_bias

# `moe_mlp` under `jit`: inside a traced model this just nests, and an eager call (e.g.
# `layer(x)` at the top level) runs one compiled program instead of op-by-op `shard_map`, which
# is an order of magnitude slower.
_moe_mlp = jax.jit(moe_mlp, static_argnums=(0,),
                   static_argnames=("routing", "mode", "activation", "aux_loss_scope", "remat"))


class MoEStats(nnx.Variable):
  """Statistics of the last call (not a parameter: `nnx.grad` and optimizers skip it)."""


class RouterBias(nnx.Variable):
  """The per-expert selection bias (not a parameter: `update_bias` moves it, not gradients)."""


class MoE(nnx.Module):
  """A mixture-of-experts layer with experts sharded over `group`'s mesh axis.

  The router is replicated; expert `e` lives on rank `e // L` (`L = E / R`). The forward pass is
  `jax_ep.moe_mlp`: routing, dispatch, grouped experts (SwiGLU by default), weighted combine,
  plus the shared expert when there is one. Precision as in Flax layers: parameters stored in
  `param_dtype` (float32 by default), cast to the compute dtype (the group's) inside the layer,
  the router in float32; the output comes back in `x`'s dtype.

  Args:
    group: the `jax_ep.Group`; gives `E` (`num_experts`), `K` (`num_topk`), `H` (`hidden`), the
      mesh and the axis the experts are split over.
    ffn: `F`, the experts' inner size.
    rngs: `nnx.Rngs`; parameters are drawn from `rngs.params()`.
    dtype: the compute dtype. It is the group's dtype (dispatch sends rows in it): None, or
      that dtype. For another, create the group with it.
    param_dtype: the storage dtype of the experts' and the shared expert's weights (default
      float32, Flax's; the group's dtype saves the per-call cast and half the memory, e.g. for
      inference). The router and its bias stay float32.
    routing: how tokens pick experts (`jax_ep.Routing`: softmax or sigmoid scores,
      renormalisation, group-limited top-k, a routed scaling factor).
    router_bias: keep a per-expert selection bias (`RouterBias`), moved by `update_bias`.
    shared_ffn: inner size of a shared expert every token goes through (0: none).
    mode: "high_throughput" (training, prefill) or "low_latency" (decode: the low-latency pair,
      experts on its slabs, SwiGLU only; the group needs `low_latency=True` on the cuda
      backend).
    activation: "swiglu" (default), "geglu" (gated: `w_gate`, `w_up`, `w_down`), "gelu" or
      "silu" (two matrices: `w_up` is None).
    aux_loss_scope: "per_shard" (the load-balancing loss of each shard's tokens) or
      "per_sequence" (each sequence of `[B, S, H]` inputs, averaged; see `jax_ep.moe_mlp`).
    remat: recompute dispatch, experts and combine in the backward (`jax_ep.moe_mlp`'s
      `remat`), keeping only the layer's input and the routing.

  Attributes:
    router: `nnx.Param` `[H, E]` float32, replicated (sharding metadata `(None, None)`).
    w_gate, w_up: `nnx.Param` `[E, H, F]` (`w_up` None for "gelu" and "silu"); w_down:
      `nnx.Param` `[E, F, H]`, in `param_dtype`, placed on the mesh sharded over the EP axis
      (sharding metadata `(axis_name, None, None)`).
    shared_gate, shared_up, shared_down: the shared expert's `nnx.Param`s, replicated.
    bias: `RouterBias` `[E]` float32 (with `router_bias=True`).
    num_dropped, aux_loss, z_loss: `MoEStats` `[M]`, one entry per shard of tokens, of the
      most recent call (`jax_ep.MoEOutput`); expert_counts: `MoEStats` `[M, E]` int32.
  """

  def __init__(self, group: Group, *, ffn: int, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32, routing: Routing = Routing(), router_bias: bool = False,
               shared_ffn: int = 0, mode: str = "high_throughput", activation: str = "swiglu",
               aux_loss_scope: str = "per_shard", remat: bool = False):
    _check_options("nnx.MoE", mode=mode, activation=activation,
                   aux_loss_scope=aux_loss_scope, remat=remat)
    if dtype is not None and jnp.dtype(dtype) != jnp.dtype(group.dtype):
      raise ValueError(f"jax_ep.nnx.MoE: dtype (the compute dtype) is the group's dtype "
                       f"{jnp.dtype(group.dtype).name}, the one dispatch sends; got "
                       f"{jnp.dtype(dtype).name}. To store the weights in it, pass "
                       f"param_dtype={jnp.dtype(dtype).name}; to compute in it, create the group "
                       f"with dtype={jnp.dtype(dtype).name}")
    if not jnp.issubdtype(param_dtype, jnp.floating):
      raise TypeError(f"jax_ep.nnx.MoE: param_dtype must be a floating-point dtype, got "
                      f"{jnp.dtype(param_dtype).name}")
    self.group = group
    self.routing = routing
    self.mode = mode
    self.activation = activation
    self.aux_loss_scope = aux_loss_scope
    self.remat = remat
    params = init_moe_params(rngs.params(), num_experts=group.num_experts, hidden=group.hidden,
                             ffn=ffn, dtype=param_dtype, shared_ffn=shared_ffn,
                             router_bias=router_bias, activation=activation)
    axis = group.axis_name
    mesh = group.mesh

    def param(value, names, kind=nnx.Param):
      value = jax.device_put(value, NamedSharding(mesh, P(*names)))
      # Already placed above; the metadata records the layout for nnx.get_partition_spec & co.
      return kind(value, out_sharding=names, mesh=mesh, eager_sharding=False)

    self.router = param(params.router, (None, None))
    self.w_gate = param(params.w_gate, (axis, None, None))
    self.w_up = None if params.w_up is None else param(params.w_up, (axis, None, None))
    self.w_down = param(params.w_down, (axis, None, None))
    self.bias = param(params.router_bias, (None,), RouterBias) if router_bias else None
    shared = lambda value: None if value is None else param(value, (None, None))  # noqa: E731
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
    return MoEParams(self.router[...], self.w_gate[...], value(self.w_up), self.w_down[...],
                     value(self.bias), value(self.shared_gate), value(self.shared_up),
                     value(self.shared_down))

  def __call__(self, x, topk_idx=None, topk_weights=None, *,
               return_output: bool = False) -> jax.Array | MoEOutput:
    """Applies the layer.

    Args:
      x: `[N, H]` or `[B, S, H]` floating-point activations (cast to the group's dtype for
        dispatch), split evenly over the group's mesh (`N / M <= max_tokens_per_rank` tokens
        per shard).
      topk_idx, topk_weights: optional routing shaped like `x` with `K` for `H`; by default
        the router decides.
      return_output: return the whole `jax_ep.MoEOutput` (the router's probabilities and
        top-k, for losses of your own) instead of its `out`.

    Returns:
      The layer's output, shaped like `x`, in its dtype (or the `MoEOutput`). The statistics
      go to the `MoEStats` attributes either way.
    """
    if not isinstance(return_output, bool):
      raise TypeError(f"jax_ep.nnx.MoE: return_output must be a bool, got {return_output!r}")
    result = _moe_mlp(self.group, self.params, x, topk_idx, topk_weights,
                      routing=self.routing, mode=self.mode, activation=self.activation,
                      aux_loss_scope=self.aux_loss_scope, remat=self.remat)
    self.num_dropped.set_value(result.num_dropped)
    self.aux_loss.set_value(result.aux_loss)
    self.z_loss.set_value(result.z_loss)
    self.expert_counts.set_value(result.expert_counts)
    return result if return_output else result.out

  def update_bias(self, rate: float = 1e-3) -> None:
    """Moves the selection bias towards balance from the last call's `expert_counts`
    (`jax_ep.update_router_bias`; DeepSeek-V3's auxiliary-loss-free balancing)."""
    if self.bias is None:
      raise ValueError("jax_ep.nnx.MoE.update_bias: the layer was created without "
                       "router_bias=True")
    self.bias.set_value(update_router_bias(self.bias[...], self.expert_counts[...], rate))
