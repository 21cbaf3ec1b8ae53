"""Where a custom call of jax_ep/backends/cuda_ops.py runs, and how it is batched there.

`looped`: XLA's compute stream, one call per batch element under a sequential vmap.
`on_stream`: XLA's additional stream N (`Group(comm_stream=N)`), the call annotated alone.
`on_own_stream`: jax_ep's own stream (`Group(comm_stream="jax_ep")`), the op then its join
(ffi/runtime/side_stream.h), which jax_ep/overlap.py may place later.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.xla_metadata import set_xla_metadata

from jax_ep._native import own_stream


def looped(fn: Callable) -> Callable:
  """`fn` (one custom call) batched by a loop over the batch, one call per element (what
  `vmap_method="sequential"` asks for), nested vmaps included.

  NOTES: XLA:GPU's dynamic-slice fusion (jaxlib 0.11.2) folds a custom call whose operands are
  dynamic slices of a loop's arrays (or whose results are written into one by a dynamic update
  slice) into a fusion that slices, calls and writes, and keeps the original call beside it when
  the call has side effects, as the peer ops do: each iteration ran the op twice (seen in the
  compiled program, `tests/test_hopper_aot.py`). Optimization barriers between the slices, the
  call and the writes keep the fusion from matching, at the cost of a copy of each iteration's
  operands and results.
  """
  batched = jax.custom_batching.custom_vmap(fn)

  @batched.def_vmap
  def _loop(axis_size, in_batched, *args):
    def one(sliced):
      it = iter(sliced)
      operands = [next(it) if b else a for a, b in zip(args, in_batched)]
      return jax.lax.optimization_barrier(batched(*jax.lax.optimization_barrier(operands)))
    outs = jax.lax.map(one, [a for a, b in zip(args, in_batched) if b])
    return outs, jax.tree.map(lambda _: True, outs)
  return batched


def unfused(fn: Callable) -> Callable:
  """`fn` (a side-effecting custom call, however placed) with optimization barriers before its
  operands and after its results, in one opaque unit, so that XLA never folds the call into a
  dynamic-slice fusion.

  NOTES: XLA:GPU's dynamic-slice fusion (jaxlib 0.11.2) rewrites a custom call whose operand is
  a dynamic slice of a loop's array, or whose result is written into one, into a fusion that
  slices, calls and writes; a call with side effects stays beside the fusion, so it runs twice.
  Under `scan` the residuals autodiff saves per iteration are such writes, and `scan` of
  `jax.checkpoint` saves the results of the calls it may not recompute: each iteration ran a
  peer op twice, the copy on the compute stream beside the original on `comm_stream`'s, and the
  ranks met the wrong calls (a timeout, or wrong values). The barriers give each result a second
  user and each operand a producer that is not a slice, which the rewriter does not match. They
  sit inside a `custom_vmap` because autodiff saves the outputs of an equation it may not
  recompute: of the unit (the barriers' outputs), not of the bare call. The compiled programs
  keep one call per lowered call (tests/test_hopper_aot.py). The ops without side effects stay
  unwrapped: a fusion replaces them, which saves a copy.
  """
  def body(*args):
    return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(list(args))))
  unit = jax.custom_batching.custom_vmap(body)

  @unit.def_vmap
  def _batched(axis_size, in_batched, *args):
    in_axes = tuple(0 if b else None for b in in_batched)
    outs = unfused(jax.vmap(fn, in_axes=in_axes))(*args)
    return outs, jax.tree.map(lambda _: True, outs)
  return unit


def on_stream(fn: Callable, stream: int, vmap_method) -> Callable:
  """`fn` (one custom call) issued on XLA's additional GPU stream `stream`.

  NOTES: XLA:GPU wraps an op annotated with `_xla_stream_annotation` into an async call: its
  start makes that stream wait for the work queued before it on the compute stream, its done
  makes the compute stream wait for the op, and the operands stay live until the done; so XLA
  runs what it schedules between the two beside the op. Only the custom call carries the
  annotation: XLA's stream assignment does not look inside an annotated region's nested calls
  or loops (a `compute_on` region holding a `jnp.where`, a nested call, failed to compile on
  the H200: no stream for it; a loop's body is the same case), so under vmap the batching
  happens outside the annotation: a sequential vmap loops outside (`looped`), each
  iteration's call annotated, and the broadcasting one broadcasts the unbatched operands
  before the one batched call.
  """
  def annotated(*args):
    with set_xla_metadata(_xla_stream_annotation=str(stream)):
      return fn(*args)
  if vmap_method == "sequential":
    return looped(annotated)
  if vmap_method != "broadcast_all":
    return annotated
  batched = jax.custom_batching.custom_vmap(annotated)

  @batched.def_vmap
  def _broadcast_then_call(axis_size, in_batched, *args):
    args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, b in zip(args, in_batched)]
    # The batched call, itself annotated alone: an outer vmap batches it by this same rule.
    outs = on_stream(jax.vmap(fn), stream, vmap_method)(*args)
    return outs, jax.tree.map(lambda _: True, outs)
  return batched


def on_own_stream(target, result_shapes, vmap_method, has_side_effect, sms: int,
                  attrs) -> Callable:
  """The op `target` on jax_ep's own stream, its grids sized to `sms` SMs, then its join: two
  custom calls.

  NOTES: the join takes the op's results (aliased to its own, so XLA reads them only after it)
  and the op's operands (so XLA keeps them until then). The two are separate equations, so
  that jax_ep/overlap.py can place the join later than here; nothing else may read the op's
  results before it. Under vmap each op joins at once, inside its batching rule: a loop's
  slices and a broadcast's copies are buffers of that iteration or that call, which XLA may
  reuse as soon as the op's equation is done, so the join that keeps them must come before.
  The join traced after the op then runs too, batched: a second wait for the same op, which
  launches nothing (it keeps the join an equation of its own for jax_ep/overlap.py).
  """
  single = not isinstance(result_shapes, (list, tuple))
  key = np.int64(0)  # jax_ep/overlap.py gives a micro-batch's ops and joins their own
  op = jax.ffi.ffi_call(target + own_stream.SUFFIX, result_shapes, vmap_method=vmap_method,
                        has_side_effect=has_side_effect)

  def launch(*args):
    outs = op(*args, **attrs, own_stream_key=key, own_stream_sms=np.int64(sms))
    return [outs] if single else list(outs)

  def join(outs, args):
    call = jax.ffi.ffi_call(
        own_stream.JOIN, [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs],
        vmap_method="broadcast_all", has_side_effect=has_side_effect,
        input_output_aliases={i: i for i in range(len(outs))})
    # The barrier keeps XLA from folding the join into a dynamic-slice fusion that writes its
    # results into a slice of another array (a scan's outputs, or the residuals a scan of
    # checkpointed layers saves: `unfused`'s NOTES, why the barrier sits in a unit): a join
    # copies nothing where its results keep their operands' buffers (ffi/handlers/join.cc
    # copies where they don't), and XLA kept the original beside the fusion's copy.
    def body(*values):
      return jax.lax.optimization_barrier(list(call(*values, own_stream_key=key)))
    unit = jax.custom_batching.custom_vmap(body)

    @unit.def_vmap
    def _broadcast(axis_size, in_batched, *values):
      joined = jax.vmap(body, in_axes=tuple(0 if b else None for b in in_batched))(*values)
      return joined, [True] * len(joined)
    return unit(*outs, *args)

  def launched(launch):
    unit = jax.custom_batching.custom_vmap(launch)

    @unit.def_vmap
    def _joined_in_batch(axis_size, in_batched, *args):
      if vmap_method == "sequential":
        # One op and its join per element, as `looped` (its NOTES: the barriers).
        def one(sliced):
          it = iter(sliced)
          operands = jax.lax.optimization_barrier(
              [next(it) if b else a for a, b in zip(args, in_batched)])
          return jax.lax.optimization_barrier(join(unit(*operands), operands))
        outs = jax.lax.map(one, [a for a, b in zip(args, in_batched) if b])
      else:
        args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, b in zip(args, in_batched)]
        # The op's own batching (one call over the batch), itself a unit for an outer vmap.
        outs = join(launched(jax.vmap(launch))(*args), args)
      return outs, [True] * len(outs)
    return unit

  unit = launched(launch)

  def fn(*args):
    # The barrier keeps XLA from folding a slice of an operand into the op (its dynamic-slice
    # fusion reads the slice's source in place): the join must hold what the op reads.
    args = jax.lax.optimization_barrier(list(args))
    outs = join(unit(*args), args)
    return outs[0] if single else outs
  return fn
