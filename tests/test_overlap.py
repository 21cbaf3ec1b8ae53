"""jax_ep's pipeline (jax_ep/overlap.py) on the CPU, with stand-ins for the ops on jax_ep's own
stream that XLA:CPU runs: each "op" is a custom call `jax_ep_test_identity_own_stream` whose
result is its operand's buffer (an alias; the handler does nothing), and its join is a
`jax_ep_join` of the same kind. The scheduler sees the names it knows, so it defers the joins,
yields, resumes and keys the micro-batches as it does on a GPU, and XLA runs the result: values
and gradients against the micro-batches in turn, the order of the ops and joins it emits, the
joins nothing reads, and ordered effects.
"""

import ctypes
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import overlap
from jax_ep._native import own_stream

OP = "jax_ep_test_identity" + own_stream.SUFFIX


class _Extension(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
              ("next", ctypes.c_void_p)]


class _Version(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
              ("major", ctypes.c_int), ("minor", ctypes.c_int)]


class _Metadata(ctypes.Structure):
  _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _Version),
              ("traits", ctypes.c_uint32)]


class _MetadataExtension(ctypes.Structure):
  _fields_ = [("base", _Extension), ("metadata", ctypes.POINTER(_Metadata))]


class _CallFrame(ctypes.Structure):  # its first two fields (xla/ffi/api/c_api.h)
  _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.POINTER(_Extension))]


@ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))
def _nothing(frame):
  """An XLA FFI handler that does nothing (its results are its operands' buffers); to XLA's
  metadata query (registration) it answers FFI API 0.1, no traits."""
  extension = frame.contents.extension_start
  if extension and extension.contents.type == 1:  # XLA_FFI_Extension_Metadata
    metadata = ctypes.cast(extension, ctypes.POINTER(_MetadataExtension)).contents.metadata
    metadata.contents.api_version.major, metadata.contents.api_version.minor = 0, 1
    metadata.contents.traits = 0
  return None


@pytest.fixture(scope="module", autouse=True)
def _stand_ins():
  for target in (OP, own_stream.JOIN):
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(_nothing), platform="cpu")


def _launch_and_join(x, has_side_effect=False):
  """`x`, through a stand-in op and its join (as jax_ep/backends/streams.py makes them)."""
  shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  key = np.int64(0)
  y = jax.ffi.ffi_call(OP, shape, input_output_aliases={0: 0},
                       has_side_effect=has_side_effect)(x, own_stream_key=key)
  return jax.ffi.ffi_call(own_stream.JOIN, shape, input_output_aliases={0: 0},
                          has_side_effect=has_side_effect)(y, x, own_stream_key=key)


@jax.custom_vjp
def _comm(x):
  """A linear "communication" op: the identity, forward and backward through stand-ins."""
  return _launch_and_join(x)


_comm.defvjp(lambda x: (_comm(x), None), lambda _, d: (_comm(d),))


def _micro_batch(w, part, idx):
  """comm -> "experts" -> comm, and a count that gets no gradient."""
  x, scale = part
  h = jnp.tanh(_comm(x) @ w) * scale[:, None]
  return _comm(h * (idx[:, None] + 1)), jnp.sum(idx)


def _inputs(micro_batches=2, tokens=8, hidden=16):
  k = jax.random.split(jax.random.key(0), 3)
  w = jax.random.normal(k[0], (hidden, hidden), jnp.float32) / 4
  xs = jax.random.normal(k[1], (micro_batches, tokens, hidden), jnp.float32)
  scales = jax.random.uniform(k[2], (micro_batches, tokens), jnp.float32)
  idxs = jnp.arange(micro_batches * tokens, dtype=jnp.int32).reshape(micro_batches, tokens) % 3
  return w, xs, scales, idxs


def _loss(split, w, xs, scales, idxs):
  parts = [(x, s) for x, s in zip(xs, scales)]
  if split:
    outs, counts = overlap.pipeline(_micro_batch, w, parts, list(idxs))
  else:
    outs, counts = zip(*(_micro_batch(w, p, i) for p, i in zip(parts, idxs)))
  return sum(jnp.sum(o ** 2) for o in outs), jnp.stack(counts)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_values_and_gradients_as_the_micro_batches_in_turn(micro_batches):
  args = _inputs(micro_batches)
  got, want = (jax.jit(jax.value_and_grad(lambda *a, s=split: _loss(s, *a), (0, 1, 2),
                                          has_aux=True))(*args) for split in (True, False))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def _calls(fn, *args):
  """(target, own_stream_key) of each stand-in call of `fn`'s lowered program, in order."""
  text = jax.jit(fn).trace(*args).lower().as_text()
  return [(t, int(k)) for t, k in re.findall(
      r"custom_call @(\w+)\(.*own_stream_key = (\d+)", text)]


def test_the_forward_interleaves_two_micro_batches_by_key():
  """Each micro-batch's ops and joins carry its key; the second's first op is launched before
  the first's first join, and the first's second op before the second's second join."""
  calls = _calls(lambda *a: _loss(True, *a)[0], *_inputs())
  assert calls == [(OP, 1), (OP, 2), ("jax_ep_join", 1), (OP, 1), ("jax_ep_join", 2),
                   (OP, 2), ("jax_ep_join", 1), ("jax_ep_join", 2)], calls


def test_the_backward_interleaves_too():
  calls = _calls(jax.grad(lambda *a: _loss(True, *a)[0], (0, 1)), *_inputs())
  assert {k for _, k in calls} == {1, 2}
  ops = [k for t, k in calls if t == OP]
  # Forward and backward, two ops each per micro-batch, alternating between them.
  assert ops == [1, 2, 1, 2, 1, 2, 1, 2], calls


def test_a_forward_alone_keeps_no_residuals():
  """Not differentiated, the micro-batches run their functions' primal (a custom_vjp's forward
  rule, which keeps residuals for a pullback, runs only under a gradient)."""
  traced = []

  @jax.custom_vjp
  def experts(x, w):
    traced.append("primal")
    return _comm(x) @ w

  def experts_fwd(x, w):
    traced.append("forward rule")
    return experts(x, w), (x, w)
  experts.defvjp(experts_fwd, lambda res, d: (d @ res[1].T, res[0].T @ d))

  def loss(w, xs):
    outs = overlap.pipeline(lambda w, x, _: (experts(x, w), ()), w, list(xs), [None, None])[0]
    return sum(jnp.sum(o) for o in outs)
  w, xs = _inputs()[:2]
  jax.jit(loss).trace(w, xs)
  assert "primal" in traced and "forward rule" not in traced, traced
  traced.clear()
  jax.jit(jax.grad(loss)).trace(w, xs)
  assert "forward rule" in traced, traced


def test_a_join_nothing_reads_still_runs():
  """An op run for its effects (`has_side_effect`), its result unread: its join is emitted
  (it keeps the op's buffers until the op ends)."""
  def one(w, part, idx):
    _launch_and_join(jax.lax.stop_gradient(part) * 2, has_side_effect=True)
    return part @ w, ()

  def fn(w, xs):
    return overlap.pipeline(one, w, list(xs), [None, None])[0]
  calls = _calls(fn, *_inputs()[:2])
  for key in (1, 2):
    assert calls.count((OP, key)) == calls.count(("jax_ep_join", key)) == 1, calls


def test_ordered_effects_keep_their_order(capfd):
  """With an ordered effect the micro-batches run one after another: the prints come out as
  in the unsplit loop."""
  def one(w, part, idx):
    y = _comm(part)
    jax.debug.print("first {}", idx, ordered=True)
    jax.debug.print("second {}", idx, ordered=True)
    return y @ w, ()

  def fn(w, xs):
    return overlap.pipeline(one, w, list(xs), [jnp.int32(0), jnp.int32(1)])[0]
  jax.block_until_ready(jax.jit(fn)(*_inputs()[:2]))
  lines = [line for line in capfd.readouterr().out.splitlines() if line[:1] in "fs"]
  assert lines == ["first 0", "second 0", "first 1", "second 1"], lines
