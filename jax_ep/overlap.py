"""Micro-batches whose communication runs beside each other's experts, on jax_ep's own stream.

With `Group(comm_stream="jax_ep")` each high-throughput op of the cuda backend is two custom
calls (jax_ep/_native/own_stream.py): the op, launched on a stream jax_ep owns once the work
XLA queued before it is done, and its join, after which XLA's stream may read the op's results.
XLA schedules both as ordinary ops, in an order of its choosing; `pipeline` decides it. It
traces each micro-batch to a program of its own (its ops keyed apart, so that joining one
micro-batch's op leaves another's running), then interleaves their equations: a program runs
until it needs the result of a join not yet run (its equations that do not need one run first),
and the next one takes over; the join runs when its program resumes. Optimization barriers keep
the ops and joins ("anchors") in the order they ran in here, each after all that was computed
since the one before. With two micro-batches the second's dispatch runs beside the first's
experts and the first's combine beside the second's, forward and backward:

  compute stream:  dispatch0's glue | dispatch1's glue | experts0 | experts1 | ...
  jax_ep's stream:        dispatch0 .......... dispatch1 ... combine0 ........ combine1

Where nothing needs a join (the reference backend; an op whose results nothing reads), the
programs run one after another, as the unsplit micro-batches would.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core, effects, source_info_util

from jax_ep._native import own_stream

# Calls whose body is inlined when it holds an op on jax_ep's own stream or a join, so that the
# join is an equation of the program's own (the parameter naming the body). custom_vjp_call's
# body is its primal, which is what runs here: `pipeline` differentiates each program itself.
_INLINED = {"pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
            "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr"}


def _targets(jaxpr: core.Jaxpr, memo: dict) -> frozenset:
  """The ffi targets that `jaxpr` calls, nested calls included."""
  found = memo.get(id(jaxpr))
  if found is None:
    names = set()
    for eqn in jaxpr.eqns:
      names |= _eqn_targets(eqn, memo)
    found = memo[id(jaxpr)] = frozenset(names)
  return found


def _eqn_targets(eqn, memo: dict) -> frozenset:
  names = {eqn.params["target_name"]} if eqn.primitive.name == "ffi_call" else set()
  for value in eqn.params.values():
    for v in value if isinstance(value, tuple) else (value,):
      if isinstance(v, core.Jaxpr):
        names |= _targets(v, memo)
  return frozenset(names)


def _ordered(effs) -> bool:
  """Whether `effs` hold an ordered effect (e.g. `jax.debug.print(..., ordered=True)`)."""
  return any(effects.ordered_effects.contains(e) for e in effs)


def _is_join(eqn) -> bool:
  """A join: its custom call, or the unit that holds it alone (streams.on_own_stream)."""
  if eqn.primitive.name == "custom_vmap_call":
    return _eqn_targets(eqn, {}) == {own_stream.JOIN}
  return eqn.primitive.name == "ffi_call" and eqn.params["target_name"] == own_stream.JOIN


def _owns(eqn, memo: dict) -> bool:
  """Whether `eqn` is, or holds, an op on jax_ep's own stream or a join."""
  return any(t.endswith(own_stream.SUFFIX) or t == own_stream.JOIN
             for t in _eqn_targets(eqn, memo))


def _keyed(eqn, key: int, memo: dict):
  """`eqn` with every op on jax_ep's own stream and every join in it given `key` (the rest of
  it as it was).

  NOTES: the key is set here rather than when the ops are traced: JAX reuses the traced body
  of a function it has seen (a custom_vjp's, a jitted helper's) across the micro-batches, so a
  key read at trace time would be the first micro-batch's in all of them. A batching rule's
  ops keep theirs: under vmap each op joins in its rule, whatever the key."""
  if not _owns(eqn, memo):
    return eqn
  params = {}
  for name, value in eqn.params.items():
    if eqn.primitive.name == "ffi_call" and name == "attributes":
      value = tuple((a, np.int64(key) if a == "own_stream_key" else v) for a, v in value)
    elif isinstance(value, tuple):
      value = tuple(_keyed_body(v, key, memo) for v in value)
    else:
      value = _keyed_body(value, key, memo)
    params[name] = value
  return eqn.replace(params=params)


def _keyed_body(value, key: int, memo: dict):
  if isinstance(value, core.Jaxpr):
    return value.replace(eqns=[_keyed(e, key, memo) for e in value.eqns])
  return value


def _bind(eqn, invals):
  params = eqn.primitive.get_bind_params(eqn.params)
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager):
    outs = eqn.primitive.bind(*invals, **params)
  return outs if eqn.primitive.multiple_results else [outs]


class _Join:
  """A join not yet run: its equation, its operands, then its results."""

  def __init__(self, eqn, invals):
    self.eqn, self.invals, self.outs = eqn, invals, None


class _Late:
  """Result `index` of a `_Join` not yet run."""

  def __init__(self, join: _Join, index: int):
    self.join, self.index = join, index


def _tieable(value) -> bool:
  """An array an optimization barrier takes (not a token, a key or a float0 cotangent)."""
  aval = jax.typeof(value)
  return (isinstance(aval, core.ShapedArray) and aval.dtype != jax.dtypes.float0
          and not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended))


class _Order:
  """The order of the interleaved programs' anchors (their ops on jax_ep's stream and their
  joins), whatever program runs them: each anchor's operands are tied after the values made
  since the anchor before it that nothing has read since (so after everything made since)."""

  def __init__(self, memo: dict):
    self.sinks: dict = {}
    self.memo = memo

  def made(self, invals, outs):
    for v in invals:
      self.sinks.pop(id(v), None)
    for v in outs:
      if _tieable(v):
        self.sinks[id(v)] = v

  def anchor(self, eqn, invals, key: int):
    if self.sinks:
      invals = jax.lax.optimization_barrier((invals, list(self.sinks.values())))[0]
    outs = _bind(_keyed(eqn, key, self.memo), invals)
    if _is_join(eqn):  # as streams.on_own_stream's join: no fusion may write its results elsewhere
      outs = jax.lax.optimization_barrier(outs)
    self.sinks = {id(v): v for v in outs if _tieable(v)}
    return outs


class _Program:
  """One micro-batch's traced program, run as a generator that yields when it needs the result
  of a join that has not run (the join runs when it resumes)."""

  def __init__(self, fn: Callable, args, key: int, order: _Order):
    closed, self.out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    self.jaxpr, self.args = closed, jax.tree.leaves(args)
    self.key, self.order, self.memo = key, order, order.memo
    self.joins: list[_Join] = []

  def run(self):
    outs = yield from self._eval(self.jaxpr, self.jaxpr.consts, self.args)
    # Every join runs, also one whose results nothing reads: its op (a peer op runs for its
    # effects) may still be running, and the join keeps its buffers until it ends.
    yield from self._resolve([_Late(join, 0) for join in self.joins])
    outs = yield from self._resolve(outs)
    return jax.tree.unflatten(jax.tree.structure(self.out_shape), outs)

  def _resolve(self, values):
    """`values` with every `_Late` replaced by its join's result, the joins not yet run run
    once the other programs have had their turn."""
    waiting = [v.join for v in values if isinstance(v, _Late) and v.join.outs is None]
    if waiting:
      yield
      for join in dict.fromkeys(waiting):
        if join.outs is None:
          join.outs = self.order.anchor(join.eqn, join.invals, self.key)
    return [v.join.outs[v.index] if isinstance(v, _Late) else v for v in values]

  def _eval(self, jaxpr: core.Jaxpr, consts, args):
    """`jaxpr`'s outputs, its equations run in order but for those that need a join not yet
    run, which wait while the ones after them that do not run; when none can run, the program
    yields, and on its return runs the joins the first waiting equation needs."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
    known = lambda v: isinstance(v, core.Literal) or v in env
    late = lambda v: isinstance(v, _Late) and v.join.outs is None
    waiting = list(jaxpr.eqns)
    while waiting:
      for n, eqn in enumerate(waiting):
        if all(map(known, eqn.invars)) and (
            _is_join(eqn) or not any(late(read(v)) for v in eqn.invars)):
          break
        if _ordered(eqn.effects):  # an ordered effect is neither overtaken nor overtakes
          n = None
          break
      else:
        n = None
      if n is None:
        first = next(e for e in waiting if all(map(known, e.invars)))
        yield from self._resolve([read(v) for v in first.invars])
        continue
      del waiting[n]
      outs = yield from self._step(eqn, [read(v) for v in eqn.invars])
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  def _step(self, eqn, invals):
    """One equation whose operands are all there (but for a join's, never late)."""
    targets = _eqn_targets(eqn, self.memo)
    launches = any(t.endswith(own_stream.SUFFIX) for t in targets)
    invals = [v.join.outs[v.index] if isinstance(v, _Late) else v for v in invals]
    if _is_join(eqn):
      join = _Join(eqn, invals)
      self.joins.append(join)
      return [_Late(join, i) for i in range(len(eqn.outvars))]
    if eqn.primitive.name in _INLINED and (launches or own_stream.JOIN in targets):
      body = eqn.params[_INLINED[eqn.primitive.name]]
      if eqn.primitive.name == "remat2" and eqn.params.get("prevent_cse", True):
        # What remat's own lowering does: XLA may not share its recomputation with the values
        # it recomputes.
        invals = jax.lax.optimization_barrier(invals)
      return (yield from self._eval(body, body.consts, invals))
    if launches:
      return self.order.anchor(eqn, invals, self.key)
    outs = _bind(_keyed(eqn, self.key, self.memo), invals)
    self.order.made(invals, outs)
    return outs


def interleave(programs: Sequence[tuple[Callable, Any]]) -> list:
  """`[fn(*args) for fn, args in programs]`, their equations interleaved (the module's NOTES):
  each program's ops on jax_ep's own stream and their joins take the key of its position (from
  1); a program that needs a join not yet run yields to the next, round the programs, and the
  anchors (ops and joins) keep the order they run in here. Programs with ordered effects run
  one after another (their joins still deferred within each)."""
  order = _Order(memo={})
  states = [_Program(fn, args, i + 1, order) for i, (fn, args) in enumerate(programs)]
  # Ordered effects keep the programs' order: each runs to its end before the next starts.
  in_turn = any(_ordered(state.jaxpr.effects) for state in states)
  runs = [state.run() for state in states]
  results: list = [None] * len(runs)
  queue = collections.deque(range(len(runs)))
  while queue:
    i = queue.popleft()
    try:
      next(runs[i])
    except StopIteration as done:
      results[i] = done.value
      continue
    if in_turn:
      queue.appendleft(i)
    else:
      queue.append(i)
  return results


def pipeline(fn: Callable, shared, parts: Sequence, fixed: Sequence):
  """`[fn(shared, part, fixed_part) for ...]`, the micro-batches interleaved by `interleave`
  in the forward and again in the backward.

  Args:
    fn: `(shared, part, fixed_part) -> (out, aux)`, differentiable in `shared` and `part`;
      `aux` (counts) gets no cotangent.
    shared: what every micro-batch reads (the weights); its gradient is the sum of theirs.
    parts: each micro-batch's differentiable inputs.
    fixed: each micro-batch's inputs without a gradient (integer routing).

  Returns:
    `(outs, auxes)`, a list of each.

  NOTES: a custom_vjp, so that the backward is interleaved too: its forward runs each
  micro-batch's `jax.vjp` as a program and keeps the pullbacks; its backward runs the pullbacks
  as programs. JAX would otherwise transpose the interleaved forward as one program, each op's
  join next to its op.
  """
  @jax.custom_vjp
  def run(shared, parts, fixed):
    # Not differentiated: the micro-batches' functions alone. Under a vjp their custom_vjps'
    # forward rules would run instead and keep residuals (the fused experts' kernels would
    # write their saved projections) that no pullback reads.
    outs, auxes = zip(*interleave([(fn, (shared, p, f)) for p, f in zip(parts, fixed)]))
    return list(outs), list(auxes)

  def forward(shared, parts, fixed):
    def program(shared, part, fixed_part):
      out, pullback, aux = jax.vjp(lambda s, p: fn(s, p, fixed_part), shared, part,
                                   has_aux=True)
      return out, aux, pullback
    results = interleave([(program, (shared, p, f)) for p, f in zip(parts, fixed)])
    outs, auxes, pullbacks = zip(*results)
    return (list(outs), list(auxes)), pullbacks

  def backward(pullbacks, cotangents):
    d_outs, _ = cotangents
    grads = interleave([(lambda pullback, d: pullback(d), (pullback, d))
                        for pullback, d in zip(pullbacks, d_outs)])
    d_shared = jax.tree.map(
        lambda *g: g[0] if g[0].dtype == jax.dtypes.float0 else sum(g[1:], g[0]),
        *[g[0] for g in grads])
    return d_shared, [g[1] for g in grads], None

  run.defvjp(forward, backward)
  return run(shared, list(parts), list(fixed))
