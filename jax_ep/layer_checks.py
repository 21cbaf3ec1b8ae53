"""The MoE layer's shape checks: each array against the group's sizes (or, for the expert MLP,
against each other), named as the caller wrote it (`params.w_gate`, `topk_idx`), so that a
wrong size fails at trace time with the argument's name rather than inside under the name of a
per-rank slice, or (a router of other width) picks experts that do not exist."""

from __future__ import annotations

import numbers

import jax.numpy as jnp

from jax_ep.config import positive_int


def _check_shape(fn: str, name: str, value, letters, want) -> None:
  """Raises unless `value` has shape `want` (None: any size there), spelled `letters`."""
  shape = getattr(value, "shape", None)
  if (shape is not None and len(shape) == len(want)
      and all(w is None or n == w for n, w in zip(shape, want))):
    return
  expected = ", ".join(letter if w is None else str(w) for letter, w in zip(letters, want))
  got = f"shape {tuple(shape)}" if shape is not None else (
      "None" if value is None else type(value).__name__)
  raise ValueError(f"jax_ep.{fn}: {name} must have shape [{', '.join(letters)}] = "
                   f"({expected}), got {got}")


def check_expert_weights(fn: str, names, w_gate, w_up, w_down, *, experts, hidden,
                         letter: str) -> None:
  """`w_gate` `[G, H, F]`, `w_up` the same (when given), `w_down` `[G, F, H]` (`experts` or
  `hidden` None: taken from the weights), named as the caller wrote them (`names`)."""
  gate, up, down = names
  _check_shape(fn, gate, w_gate, (letter, "H", "F"), (experts, hidden, None))
  experts, hidden, ffn = w_gate.shape
  if w_up is not None:
    _check_shape(fn, up, w_up, (letter, "H", "F"), (experts, hidden, ffn))
  _check_shape(fn, down, w_down, (letter, "F", "H"), (experts, ffn, hidden))


def check_layer_shapes(fn: str, group, params, x, topk_idx, topk_weights, *,
                       per_shard: bool, fp8: bool = False) -> None:
  """The layer's arrays against the group's sizes, named as the caller wrote them. A router
  of other width would pick experts that do not exist (slots that select nothing), and other
  weights would fail inside under the names of the per-rank slices."""
  e, h, k = group.num_experts, group.hidden, group.num_topk
  if group.config.wire_format.is_fp8 and not fp8:
    # The experts would take the e4m3 rows as their bf16 operands.
    raise ValueError(f"jax_ep.{fn}: this group's dispatch sends e4m3 rows (wire_format="
                     f"{group.config.wire_format}): the layer's experts take them with "
                     f"fp8=True (the FP8 recipe), or create the group without wire_format")
  if fp8:
    ffn = getattr(params.w_gate, "shape", (0,))[-1]
    if h % 128 or ffn % 128:
      raise ValueError(f"jax_ep.{fn}: fp8=True scales blocks of 128 channels: the hidden size "
                       f"H = {h} and the experts' F = {ffn} (params.w_gate's last dimension) "
                       f"must be multiples of 128")
  if x.shape[-1] != h:
    raise ValueError(f"jax_ep.{fn}: x must have the group's hidden size H = {h} as its last "
                     f"dimension, got shape {x.shape}")
  _check_shape(fn, "params.router", params.router, ("H", "E"), (h, e))
  if params.router_bias is not None:
    _check_shape(fn, "params.router_bias", params.router_bias, ("E",), (e,))
  experts, letter = (group.num_local_experts, "L") if per_shard else (e, "E")
  check_expert_weights(fn, ("params.w_gate", "params.w_up", "params.w_down"), params.w_gate,
                       params.w_up, params.w_down, experts=experts, hidden=h, letter=letter)
  if (params.shared_gate is None) != (params.shared_down is None):
    raise ValueError(f"jax_ep.{fn}: params.shared_gate and params.shared_down make the shared "
                     f"expert together: pass both or neither, got shared_gate "
                     f"{getattr(params.shared_gate, 'shape', None)} and shared_down "
                     f"{getattr(params.shared_down, 'shape', None)}")
  if params.shared_gate is not None:
    _check_shape(fn, "params.shared_gate", params.shared_gate, ("H", "Fs"), (h, None))
    fs = params.shared_gate.shape[1]
    if params.shared_up is not None:
      _check_shape(fn, "params.shared_up", params.shared_up, ("H", "Fs"), (h, fs))
    _check_shape(fn, "params.shared_down", params.shared_down, ("Fs", "H"), (fs, h))
  if (topk_idx is None) != (topk_weights is None):
    given, missing = (("topk_idx", "topk_weights") if topk_weights is None
                      else ("topk_weights", "topk_idx"))
    raise ValueError(f"jax_ep.{fn}: {given} is given without {missing}: pass both (the "
                     f"routing) or neither (the router in params decides)")
  if topk_idx is not None:
    tokens = (("T",) if per_shard else ("N",)) if x.ndim == 2 else ("B", "S")
    want = (*x.shape[:-1], k)
    _check_shape(fn, "topk_idx", topk_idx, (*tokens, "K"), want)
    _check_shape(fn, "topk_weights", topk_weights, (*tokens, "K"), want)


def check_init_sizes(num_experts, hidden, ffn, shared_ffn, dtype) -> None:
  """`init_moe_params`' sizes and dtype, each refused by name (a size below one would reach
  `jax.random` as a negative dimension or the fan-in scale as a division by zero)."""
  where = "jax_ep.init_moe_params"
  for name, value in (("num_experts", num_experts), ("hidden", hidden), ("ffn", ffn)):
    positive_int(name, value, where)
  if isinstance(shared_ffn, bool) or not isinstance(shared_ffn, numbers.Integral):
    raise TypeError(f"{where}: shared_ffn must be an int (0: no shared expert), got "
                    f"{shared_ffn!r}")
  if shared_ffn < 0:
    raise ValueError(f"{where}: shared_ffn must be >= 0 (0: no shared expert), got {shared_ffn}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{where}: dtype (the experts' storage dtype) must be a floating-point "
                    f"dtype, got {jnp.dtype(dtype).name}")
