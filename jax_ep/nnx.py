"""Flax NNX module of the expert-parallel MoE layer (optional: needs `flax`).

`jax_ep/__init__.py` does not import this module, so jax_ep works without flax. Use::

  from jax_ep.nnx import MoE

  layer = MoE(group, ffn=4 * group.hidden, rngs=nnx.Rngs(0))   # float32 weights, the
  out = layer(x)                        # group's dtype in the experts; x: [N, H] or [B, S, H]
  loss = task_loss + 1e-2 * layer.aux_loss[...].mean()
  layer.update_bias(rate=1e-3)          # auxiliary-loss-free balancing (with router_bias=True)

One module trains and decodes: `layer(x, mode="low_latency")` runs the decode pair on the
weights training updates (on `decode_group` when one is given). The module follows Flax's
recipes: its weights carry their sharding as metadata, so it can be built under `nnx.vmap` and
run under `nnx.scan` over layers, `nnx.remat` and `nnx.jit` (examples/moe_transformer.py).
"""

from __future__ import annotations

import logging
import math

try:
  from flax import nnx
  from flax.errors import TraceContextError
except ImportError as e:  # pragma: no cover - exercised where flax is missing
  raise ImportError("jax_ep.nnx needs flax: pip install 'jax_ep[nnx]' (or pip install "
                    "'flax>=0.12')") from e

import jax
import jax.numpy as jnp

from jax_ep.group import Group
from jax_ep.layer import (MODES, MoEOutput, MoEParams, _check_options, _token_axes,
                          check_micro_batch_tokens, check_micro_batches, init_moe_params,
                          moe_mlp)
from jax_ep.routing import Routing, update_router_bias

_logger = logging.getLogger("jax_ep")
_SAID: set[str] = set()

# `moe_mlp` under `jit`: inside a traced model this just nests, and an eager call (e.g.
# `layer(x)` at the top level) runs one compiled program instead of op-by-op `shard_map`, which
# is an order of magnitude slower.
_moe_mlp = jax.jit(moe_mlp, static_argnums=(0,),
                   static_argnames=("routing", "mode", "activation", "aux_loss_scope", "remat",
                                    "micro_batches", "fp8"))


class MoEStats(nnx.Variable):
  """Statistics of the last call (not a parameter: `nnx.grad` and optimizers skip it)."""


class RouterBias(nnx.Variable):
  """The per-expert selection bias (not a parameter: `update_bias` moves it, not gradients)."""


def _check_decode_group(group: Group, decode_group) -> None:
  """The decode group runs the same weights: the same experts on the same ranks, the same
  router and hidden size."""
  if decode_group is None:
    return
  if not isinstance(decode_group, Group):
    raise TypeError(f"jax_ep.nnx.MoE: decode_group must be a jax_ep.Group or None, got "
                    f"{type(decode_group).__name__}")
  for field in ("axis_name", "num_experts", "num_topk", "hidden"):
    want, got = getattr(group, field), getattr(decode_group, field)
    if want != got:
      raise ValueError(f"jax_ep.nnx.MoE: decode_group has {field}={got!r} but group has "
                       f"{field}={want!r}; the two groups run the same weights and must agree")
  if decode_group.mesh != group.mesh:
    raise ValueError(f"jax_ep.nnx.MoE: decode_group's mesh {decode_group.mesh} is not group's "
                     f"mesh {group.mesh}; the two groups run the same weights and must agree")


def _check_call(group: Group, which: str, mode: str, x, topk_idx, topk_weights,
                micro_batches: int) -> None:
  """Trace-time checks of a call's arguments against the group `mode` runs on (`which`
  names it: "group" or "decode_group"), split into `micro_batches`."""
  fn = "jax_ep.nnx.MoE"
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{fn}: x must be an array, got {type(x).__name__}")
  if x.ndim not in (2, 3):
    raise ValueError(f"{fn}: x must be [N, H] or [B, S, H], got shape {x.shape}")
  if x.shape[-1] != group.hidden:
    raise ValueError(f"{fn}: x has hidden size {x.shape[-1]} (shape {x.shape}) but the layer "
                     f"was built for hidden={group.hidden} (its group's)")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{fn}: x must have a floating-point dtype (it is cast to the group's "
                    f"{jnp.dtype(group.dtype).name} for dispatch), got {x.dtype}")
  num_tokens = math.prod(x.shape[:-1])
  num_shards = group.mesh.devices.size
  if num_tokens % num_shards:
    raise ValueError(f"{fn}: x has {num_tokens} tokens (shape {x.shape}), which do not split "
                     f"evenly over the mesh's {num_shards} devices")
  check_micro_batch_tokens("nnx.MoE", group, micro_batches, num_tokens // num_shards,
                           f"x shape {x.shape} over the mesh's {num_shards} devices")
  if micro_batches == 1 and num_tokens // num_shards > group.max_tokens_per_rank:
    raise ValueError(f"{fn}: x has {num_tokens} tokens (shape {x.shape}), "
                     f"{num_tokens // num_shards} per device over the mesh's {num_shards} "
                     f"devices, more than max_tokens_per_rank={group.max_tokens_per_rank} of "
                     f"the {which} that mode={mode!r} runs on")
  if (topk_idx is None) != (topk_weights is None):
    raise ValueError(f"{fn}: pass topk_idx and topk_weights together, or neither (the router "
                     f"decides)")
  if topk_idx is None:
    return
  want = (*x.shape[:-1], group.num_topk)
  for name, value, kind, kind_name in (("topk_idx", topk_idx, jnp.integer, "an integer"),
                                       ("topk_weights", topk_weights, jnp.floating,
                                        "a floating-point")):
    if not hasattr(value, "shape") or tuple(value.shape) != want:
      raise ValueError(f"{fn}: {name} must have shape {want} (x's tokens, K={group.num_topk}), "
                       f"got {getattr(value, 'shape', type(value).__name__)}")
    if not jnp.issubdtype(value.dtype, kind):
      raise TypeError(f"{fn}: {name} must have {kind_name} dtype, got {value.dtype}")


class MoE(nnx.Module):
  """A mixture-of-experts layer with experts sharded over `group`'s mesh axis.

  The router is replicated; expert `e` lives on rank `e // L` (`L = E / R`). The forward pass is
  `jax_ep.moe_mlp`: routing, dispatch, grouped experts (SwiGLU by default), weighted combine,
  plus the shared expert when there is one. Precision as in Flax layers: parameters stored in
  `param_dtype` (float32 by default), cast to the compute dtype (the group's) inside the layer,
  the router in float32; the output comes back in `x`'s dtype.

  Flax's recipes work: every variable carries its sharding as metadata (`out_sharding`, read by
  `nnx.get_partition_spec`) and Flax lays it out when it is created (eager sharding, Flax's
  default; under `nnx.vmap` as a sharding constraint with the stacked axis unsplit), so the
  module can be built under `nnx.vmap` and run under `nnx.scan` over layers, `nnx.remat`,
  `nnx.jit` and inside `jax.lax` loops, on meshes of Auto or Explicit axes. The statistics are
  created with the sharding the layer gives them, so a compiled step does not compile again.

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
    mode: the default of each call's `mode`: "high_throughput" (training, prefill) or
      "low_latency" (decode: the low-latency pair, experts on its slabs, SwiGLU only).
    activation: "swiglu" (default), "geglu" (gated: `w_gate`, `w_up`, `w_down`), "gelu" or
      "silu" (two matrices: `w_up` is None).
    aux_loss_scope: "per_shard" (the load-balancing loss of each shard's tokens) or
      "per_sequence" (each sequence of `[B, S, H]` inputs, averaged; see `jax_ep.moe_mlp`).
    remat: recompute dispatch, experts and combine in the backward (`jax_ep.moe_mlp`'s
      `remat`), keeping only the layer's input and the routing.
    micro_batches: split each shard's tokens of a "high_throughput" call into this many
      micro-batches, each with its own dispatch -> experts -> combine (`jax_ep.moe_mlp`'s
      `micro_batches`; default 1); it must divide each shard's token count, and each
      micro-batch must fit the group's `max_tokens_per_rank`. Decode calls
      (`mode="low_latency"`) run unsplit.
    decode_group: the group calls with `mode="low_latency"` run on (None: `group`). Decode
      passes few tokens, so its group has a smaller `max_tokens_per_rank` (and, on the cuda
      backend, `low_latency=True` for the decode kernels' buffers); it must have `group`'s mesh,
      axis, `E`, `K` and `H`, since it runs the same weights. On GPUs with the extension built
      its backend is cuda and decode takes the low-latency kernels; elsewhere the reference.
    fp8: run the experts of "high_throughput" calls in FP8, DeepSeek-V3's recipe
      (`jax_ep.moe_mlp`'s `fp8`; default False); the weights stay in `param_dtype` (the
      masters, quantised once per call). Decode calls (`mode="low_latency"`) run the experts
      in the group's dtype.
    statistics: record each call's statistics in the `MoEStats` attributes (default True).
      False creates none and writes none: the module then has only its weights (and the
      bias). Where Flax forbids the write (a `jax.lax` loop body that closes over the module,
      rather than `nnx.fori_loop` / `nnx.scan` passing it in) the call skips it; the values
      are in `return_output=True`'s result either way.

  Attributes:
    router: `nnx.Param` `[H, E]` float32, replicated (sharding metadata `(None, None)`).
    w_gate, w_up: `nnx.Param` `[E, H, F]` (`w_up` None for "gelu" and "silu"); w_down:
      `nnx.Param` `[E, F, H]`, in `param_dtype`, sharded over the EP axis (sharding metadata
      `(axis_name, None, None)`).
    shared_gate, shared_up, shared_down: the shared expert's `nnx.Param`s, replicated.
    bias: `RouterBias` `[E]` float32 (with `router_bias=True`).
    num_dropped, aux_loss, z_loss: `MoEStats` `[M]`, one entry per shard of tokens, of the
      most recent call (`jax_ep.MoEOutput`); expert_counts: `MoEStats` `[M, E]` int32; split
      over every mesh axis as the layer's tokens are (sharding metadata
      `((*other_axes, axis_name),)`). None with `statistics=False`.
  """

  def __init__(self, group: Group, *, ffn: int, rngs: nnx.Rngs, dtype=None,
               param_dtype=jnp.float32, routing: Routing = Routing(), router_bias: bool = False,
               shared_ffn: int = 0, mode: str = "high_throughput", activation: str = "swiglu",
               aux_loss_scope: str = "per_shard", remat: bool = False,
               micro_batches: int = 1, decode_group: Group | None = None,
               statistics: bool = True, fp8: bool = False):
    _check_options("nnx.MoE", mode=mode, activation=activation,
                   aux_loss_scope=aux_loss_scope, remat=remat)
    if not isinstance(fp8, bool):
      raise TypeError(f"jax_ep.nnx.MoE: fp8 must be a bool, got {fp8!r}")
    if fp8 and (group.hidden % 128 or ffn % 128):
      raise ValueError(f"jax_ep.nnx.MoE: fp8=True scales blocks of 128 channels: the group's "
                       f"hidden size {group.hidden} and ffn={ffn} must be multiples of 128")
    micro_batches = check_micro_batches("nnx.MoE", micro_batches, "high_throughput")
    if dtype is not None and jnp.dtype(dtype) != jnp.dtype(group.dtype):
      raise ValueError(f"jax_ep.nnx.MoE: dtype (the compute dtype) is the group's dtype "
                       f"{jnp.dtype(group.dtype).name}, the one dispatch sends; got "
                       f"{jnp.dtype(dtype).name}. To store the weights in it, pass "
                       f"param_dtype={jnp.dtype(dtype).name}; to compute in it, create the group "
                       f"with dtype={jnp.dtype(dtype).name}")
    if not jnp.issubdtype(param_dtype, jnp.floating):
      raise TypeError(f"jax_ep.nnx.MoE: param_dtype must be a floating-point dtype, got "
                      f"{jnp.dtype(param_dtype).name}")
    if not isinstance(statistics, bool):
      raise TypeError(f"jax_ep.nnx.MoE: statistics must be a bool, got {statistics!r}")
    _check_decode_group(group, decode_group)
    self.group = group
    self.decode_group = decode_group
    self.routing = routing
    self.mode = mode
    self.activation = activation
    self.aux_loss_scope = aux_loss_scope
    self.remat = remat
    self.micro_batches = micro_batches
    self.statistics = statistics
    self.fp8 = fp8
    params = init_moe_params(rngs.params(), num_experts=group.num_experts, hidden=group.hidden,
                             ffn=ffn, dtype=param_dtype, shared_ffn=shared_ffn,
                             router_bias=router_bias, activation=activation)
    axis = group.axis_name
    mesh = group.mesh

    def variable(value, names, kind=nnx.Param):
      # The layout is metadata that Flax applies (a sharding constraint inside a transform,
      # where a device_put would claim the stacked axis of nnx.vmap for the experts' axis).
      return kind(value, out_sharding=names, mesh=mesh)

    self.router = variable(params.router, (None, None))
    self.w_gate = variable(params.w_gate, (axis, None, None))
    self.w_up = None if params.w_up is None else variable(params.w_up, (axis, None, None))
    self.w_down = variable(params.w_down, (axis, None, None))
    self.bias = variable(params.router_bias, (None,), RouterBias) if router_bias else None
    shared = lambda value: None if value is None else variable(value, (None, None))  # noqa: E731
    self.shared_gate = shared(params.shared_gate)
    self.shared_up = shared(params.shared_up)
    self.shared_down = shared(params.shared_down)
    # Laid out as the layer returns them (one entry per shard of tokens, split over every
    # mesh axis): on Explicit axes the layout is part of the type, and a replicated start would
    # compile the step a second time once the first call wrote them.
    token_axes = _token_axes(group)
    num_shards = math.prod(mesh.shape[a] for a in token_axes)

    def stat(dtype, *rest):
      if not statistics:
        return None
      return variable(jnp.zeros((num_shards, *rest), dtype), (token_axes,) + (None,) * len(rest),
                      MoEStats)

    self.num_dropped = stat(jnp.int32)
    self.aux_loss = stat(jnp.float32)
    self.z_loss = stat(jnp.float32)
    self.expert_counts = stat(jnp.int32, group.num_experts)

  @property
  def params(self) -> MoEParams:
    """The current weights as a `jax_ep.MoEParams` (global arrays)."""
    value = lambda v: None if v is None else v[...]
    return MoEParams(self.router[...], self.w_gate[...], value(self.w_up), self.w_down[...],
                     value(self.bias), value(self.shared_gate), value(self.shared_up),
                     value(self.shared_down))

  def __call__(self, x, topk_idx=None, topk_weights=None, *, mode: str | None = None,
               return_output: bool = False) -> jax.Array | MoEOutput:
    """Applies the layer.

    Args:
      x: `[N, H]` or `[B, S, H]` floating-point activations (cast to the group's dtype for
        dispatch), split evenly over the group's mesh (`N / M <= max_tokens_per_rank` tokens
        per shard, of `decode_group` in "low_latency" mode where there is one; per
        micro-batch with `micro_batches`).
      topk_idx, topk_weights: optional routing shaped like `x` with `K` for `H` (integer ids,
        floating weights); by default the router decides.
      mode: "high_throughput" (training, prefill) or "low_latency" (decode, on `decode_group`
        where there is one); None: the module's `mode`. Both run the same weights.
      return_output: return the whole `jax_ep.MoEOutput` (the router's probabilities and
        top-k, for losses of your own) instead of its `out`.

    Returns:
      The layer's output, shaped like `x`, in its dtype (or the `MoEOutput`). With
      `statistics=True` the statistics also go to the `MoEStats` attributes.

    Raises:
      `jax_ep.CapacityOverflowError` / `TimeoutError`: the group failed at run time (a strict
      group dropped rows, a peer timed out). Checked each time the call runs in Python (eagerly,
      or while a program containing it is traced), not by a compiled program run again.
    """
    if not isinstance(return_output, bool):
      raise TypeError(f"jax_ep.nnx.MoE: return_output must be a bool, got {return_output!r}")
    mode = self.mode if mode is None else mode
    if mode not in MODES:
      raise ValueError(f"jax_ep.nnx.MoE: mode must be None, 'high_throughput' or "
                       f"'low_latency', got {mode!r}")
    _check_options("nnx.MoE", mode=mode, activation=self.activation,
                   aux_loss_scope=self.aux_loss_scope, remat=self.remat)
    decode = mode == "low_latency" and self.decode_group is not None
    group = self.decode_group if decode else self.group
    micro_batches = self.micro_batches if mode == "high_throughput" else 1
    _check_call(group, "decode_group" if decode else "group", mode, x, topk_idx, topk_weights,
                micro_batches)
    if (mode == "low_latency" and group.backend_name == "cuda" and not group.low_latency):
      raise ValueError(f"jax_ep.nnx.MoE: mode='low_latency' on the cuda backend needs a group "
                       f"created with low_latency=True; {group} was not (pass one as "
                       f"decode_group)")
    # `_moe_mlp` keeps its traces, so a program traced after the group failed would reuse one
    # without reaching the ops' own check: refuse here, at every call that runs in Python.
    group.check()
    result = _moe_mlp(group, self.params, x, topk_idx, topk_weights,
                      routing=self.routing, mode=mode, activation=self.activation,
                      aux_loss_scope=self.aux_loss_scope, remat=self.remat,
                      micro_batches=micro_batches,
                      fp8=self.fp8 and mode == "high_throughput")
    if self.statistics:
      self._record(result)
    return result if return_output else result.out

  def _record(self, result: MoEOutput) -> None:
    pairs = ((self.num_dropped, result.num_dropped), (self.aux_loss, result.aux_loss),
             (self.z_loss, result.z_loss), (self.expert_counts, result.expert_counts))
    try:
      for variable, value in pairs:
        variable.set_value(value)
    except TraceContextError:
      # A jax.lax loop body that closes over the module: Flax lets no variable created outside
      # it change there. The statistics stay those of the last call outside such a loop.
      if "unrecorded" not in _SAID:
        _SAID.add("unrecorded")
        _logger.info("jax_ep.nnx.MoE: statistics not recorded inside a jax.lax loop that "
                     "closes over the module (nnx.fori_loop / nnx.scan record them; "
                     "statistics=False records none)")

  def update_bias(self, rate: float = 1e-3, expert_counts=None) -> None:
    """Moves the selection bias towards balance (`jax_ep.update_router_bias`; DeepSeek-V3's
    auxiliary-loss-free balancing).

    Args:
      rate: the step size.
      expert_counts: `[M, E]` or `[E]` slots routed to each expert (`MoEOutput.expert_counts`);
        None: the last recorded call's (`statistics=True`).
    """
    if self.bias is None:
      raise ValueError("jax_ep.nnx.MoE.update_bias: the layer was created without "
                       "router_bias=True")
    if expert_counts is None:
      if self.expert_counts is None:
        raise ValueError("jax_ep.nnx.MoE.update_bias: the layer records no statistics "
                         "(statistics=False); pass expert_counts (MoEOutput.expert_counts of "
                         "a call with return_output=True)")
      expert_counts = self.expert_counts[...]
    self.bias.set_value(update_router_bias(self.bias[...], expert_counts, rate))
