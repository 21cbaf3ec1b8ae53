"""`Group(comm_stream=N)`: the cuda backend's high-throughput ops on XLA's additional stream N,
and `comm_stream="jax_ep"`: on jax_ep's own stream, each op followed by its join.

On the CPU: the programs the cuda backend lowers for a GPU (cross-lowering, no GPU needed) carry
the stream annotation on the ops' custom calls and on nothing else, under jit, shard_map, grad,
vmap, checkpoint and scan, and none without the option; on jax_ep's own stream every op is the
`_own_stream` target, joined after it with its key, and jax_ep's pipeline (jax_ep/overlap.py)
interleaves two micro-batches' ops and joins in the order it means to. On the GPU (`gpu`): the
ops on their own stream give the compute stream's results bit for bit, in the same
transformations.
"""

import dataclasses
import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_test_base import rank_mesh, require_gpu
from jax_ep._native import ffi, own_stream
from jax_ep import overlap
from jax_ep.backends import primitives
from jax_ep.backends.cuda import LocalBackend, NetworkBackend, PeerBackend
from jax_ep.backends.options import MAX_COMM_STREAM, CommOptions
from jax_ep.config import EPConfig, RowFormat

T, E, K, H = 16, 8, 2, 128
PROGRAMS = ["jit", "shard_map_grad", "grad", "checkpoint_grad", "vmap", "vmap_vmap", "scan",
            "scan_checkpoint_grad"]

needs_extension = pytest.mark.skipif(
    ffi.extension() is None, reason="needs the built extension (cuda_ops refuses without it)")


def _config(num_ranks):
  return EPConfig("ep", num_ranks, E, K, H, T, np.dtype(jnp.bfloat16), num_ranks * T * K)


def _backend(kind, stream, num_sms=24):
  options = CommOptions(comm_stream=stream, num_sms=num_sms)
  if kind == "local":
    return LocalBackend(_config(1), None, options)
  if kind == "local_fp8":
    return LocalBackend(dataclasses.replace(_config(1), wire_format=RowFormat.FP8), None,
                        options)
  if kind == "network":  # two hosts of one rank: the rail exchange, then the local ops
    return NetworkBackend(_config(2), 0, options, hosts=((0,), (1,)))
  return PeerBackend(_config(2), 0, options)


def _layer(backend, devices=None):
  """dispatch -> a scaling "expert" -> weighted combine, differentiable in x and the weights
  (the fp8 dispatch's rows dequantised first); a network backend's inside shard_map over its
  ranks (its ops read their rank) of `devices` (default: jax.devices())."""
  def layer(x, idx, w):
    if backend.config.wire_format == RowFormat.PLAIN:
      recv_x, _, _, _, layout = primitives.dispatch(backend, x, idx, w)
    else:
      q, scales, _, _, _, layout = primitives.dispatch_fp8(backend, x, None, idx, w)
      recv_x = primitives.dequantize(q, scales, x.dtype)
    return primitives.combine(backend, recv_x * 2, layout, w)
  if isinstance(backend, NetworkBackend):
    num_ranks = backend.config.num_ranks
    devices = devices or jax.devices()
    if len(devices) < num_ranks:
      # One GPU: its programs are only lowered (for CUDA) here, over the host's CPU devices.
      devices = jax.devices("cpu")
    mesh = jax.make_mesh((num_ranks,), ("ep",), devices=devices[:num_ranks],
                         axis_types=(jax.sharding.AxisType.Auto,))
    spec = P("ep")
    per_rank = lambda x, idx, w: layer(x[0], idx[0], w[0])[None]
    sharded = jax.shard_map(per_rank, mesh=mesh, in_specs=spec, out_specs=spec)
    return lambda x, idx, w: sharded(*(jnp.stack([a] * backend.config.num_ranks)
                                       for a in (x, idx, w)))[0]
  return layer


def _programs(backend, devices=None):
  layer = _layer(backend, devices)
  loss = lambda x, idx, w: jnp.sum(layer(x, idx, w).astype(jnp.float32) ** 2)

  def scanned(x, idx, w):
    return jax.lax.scan(lambda h, _: (layer(h, idx, w), None), x, None, length=2)[0]

  def stack_loss(x, idx, w):  # a scan of checkpointed layers: each saves its ops' results
    step = jax.checkpoint(lambda h, _: (layer(h, idx, w), None))
    return jnp.sum(jax.lax.scan(step, x, None, length=2)[0].astype(jnp.float32) ** 2)

  mesh = jax.make_mesh((1,), ("ep",), devices=(devices or jax.devices())[:1])
  sharded = jax.shard_map(layer, mesh=mesh, in_specs=P(), out_specs=P())
  return {
      "jit": layer,
      "shard_map_grad": jax.grad(
          lambda x, idx, w: jnp.sum(sharded(x, idx, w).astype(jnp.float32) ** 2), (0, 2)),
      "grad": jax.grad(loss, (0, 2)),
      "checkpoint_grad": jax.grad(jax.checkpoint(loss), (0, 2)),
      "vmap": lambda x, idx, w: jax.vmap(layer, (0, None, None))(jnp.stack([x, x]), idx, w),
      "vmap_vmap": lambda x, idx, w: jax.vmap(jax.vmap(layer, (0, None, 0)), (0, None, None))(
          jnp.stack([jnp.stack([x, x])] * 2), idx, jnp.stack([w, w])),
      "scan": scanned,
      "scan_checkpoint_grad": jax.grad(stack_loss, (0, 2)),
  }


def _inputs():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
  idx = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
  w = jnp.asarray(rng.random((T, K)), jnp.float32)
  return x, idx, w


def _lowered_ops(fn):
  """(custom call target or op name, its stream annotation) of every op of `fn`'s program as
  lowered for a GPU that carries an annotation, and every jax_ep custom call."""
  text = jax.jit(fn).trace(*_inputs()).lower(lowering_platforms=("cuda",)).as_text()
  ops = []
  for line in text.splitlines():
    stream = re.search(r'_xla_stream_annotation = "(\w+)"', line)
    target = re.search(r"custom_call @(\w+)", line)
    if target and target.group(1).startswith("jax_ep_") or stream:
      op = re.search(r"(\w+\.\w+|\w+)[ (]", line.split("=", 1)[-1].strip())
      name = target.group(1) if target else op.group(1)
      ops.append((name, stream.group(1) if stream else None))
  return ops


# (The network backend's layer is inside its own shard_map already.)
CASES = [(kind, program) for kind in ("local", "peer", "local_fp8", "network")
         for program in PROGRAMS if (kind, program) != ("network", "shard_map_grad")]


@needs_extension
@pytest.mark.parametrize("kind,program", CASES)
def test_the_ops_custom_calls_carry_the_stream(kind, program):
  ops = _lowered_ops(_programs(_backend(kind, 3))[program])
  calls = [(name, s) for name, s in ops if name.startswith("jax_ep_")]
  assert calls, ops
  # Every custom call of the ops on stream 3 ...
  assert all(s == "3" for _, s in calls), calls
  # ... and nothing else: the glue around them (slices, casts, a sequential vmap's loop) stays
  # on the compute stream, where XLA's stream assignment finds it.
  others = [(name, s) for name, s in ops if not name.startswith("jax_ep_")]
  assert others == [], others
  if program == "vmap" and kind == "peer":  # one call per batch element, inside a loop
    text = jax.jit(_programs(_backend(kind, 3))[program]).trace(*_inputs()).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" in text


def _anchors(fn, *args, attribute="own_stream_key"):
  """(custom call target, `attribute`) of every jax_ep custom call of `fn`'s program as
  lowered for a GPU, in program order; the text, to check for stream annotations."""
  text = jax.jit(fn).trace(*(args or _inputs())).lower(lowering_platforms=("cuda",)).as_text()
  calls = []
  for line in text.splitlines():
    target = re.search(r"custom_call @(jax_ep_\w+)", line)
    if target:
      key = re.search(attribute + r" = (\d+)", line)
      calls.append((target.group(1), int(key.group(1)) if key else None))
  return calls, text


def _unjoined_ops(jaxpr) -> list:
  """The equations that launch an op on jax_ep's own stream (the op's custom call, or the
  batching unit around it) whose results no `jax_ep_join` (or unit of one) of the same jaxpr
  takes; nested jaxprs are searched the same way (a batching rule joins inside its own
  body)."""
  def launches(eqn):
    if eqn.primitive.name == "ffi_call":
      return eqn.params["target_name"].endswith("_own_stream")
    return eqn.primitive.name == "custom_vmap_call" and any(
        launches(e) for e in eqn.params["call"].eqns)
  # (`pvary`, which shard_map's types add between an op's results and its join, is no op.)
  source = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name == "pvary"
            and len(e.invars) == 1}
  def is_join(eqn):  # the join's custom call, or the unit that holds it (streams.py)
    if eqn.primitive.name == "custom_vmap_call":
      return any(is_join(e) for e in eqn.params["call"].eqns)
    return eqn.primitive.name == "ffi_call" and eqn.params["target_name"] == "jax_ep_join"
  joined = {source.get(v, v) for e in jaxpr.eqns if is_join(e) for v in e.invars}
  found = [e for e in jaxpr.eqns if launches(e) and not set(e.outvars) <= joined]
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "custom_vmap_call":
      for value in eqn.params.values():
        for sub in value if isinstance(value, tuple) else (value,):
          if isinstance(sub, jax.extend.core.Jaxpr):
            found += _unjoined_ops(sub)
  return found


@needs_extension
@pytest.mark.parametrize("kind,program", CASES)
def test_own_stream_ops_are_each_joined_after_them(kind, program):
  fn = _programs(_backend(kind, "jax_ep"))[program]
  calls, text = _anchors(fn)
  ops = [i for i, (target, _) in enumerate(calls) if target != "jax_ep_join"]
  assert ops, calls
  assert all(calls[i][0].endswith("_own_stream") for i in ops), calls
  # Outside jax_ep's pipeline every op and join has key 0 ...
  assert {key for _, key in calls} == {0}, calls
  # ... and a join takes every result of each op.
  assert _unjoined_ops(jax.make_jaxpr(fn)(*_inputs()).jaxpr) == []
  assert "_xla_stream_annotation" not in text


@needs_extension
@pytest.mark.parametrize("kind", ["local", "peer", "local_fp8", "network"])
def test_own_stream_ops_take_the_groups_sm_budget(kind):
  # Every op on jax_ep's own stream sizes its grids to the group's num_sms (the handler's
  # `own_stream_sms`); the joins launch nothing and take none.
  for num_sms in (24, 132):
    calls, _ = _anchors(_programs(_backend(kind, "jax_ep", num_sms))["grad"],
                        attribute="own_stream_sms")
    ops = {(target, sms) for target, sms in calls if target != "jax_ep_join"}
    assert ops and {sms for _, sms in ops} == {num_sms}, calls
    assert {sms for target, sms in calls if target == "jax_ep_join"} == {None}, calls
  # On XLA's streams the handlers are the compute stream's: no budget attribute.
  calls, _ = _anchors(_programs(_backend(kind, 1))["grad"], attribute="own_stream_sms")
  assert calls and {sms for _, sms in calls} == {None}, calls


def _micro_batch_layer(backend):
  """Two micro-batches of `_layer`'s dispatch -> scaling "expert" -> combine, interleaved by
  jax_ep's pipeline; differentiable in x and the weights."""
  def one(scale, part, idx):
    x, w = part
    recv_x, _, _, _, layout = primitives.dispatch(backend, x, idx, w)
    return primitives.combine(backend, jnp.tanh(recv_x * scale), layout, w), ()

  def layer(x, idx, w):
    halves = [jnp.split(a, 2) for a in (x, idx, w)]
    outs, _ = overlap.pipeline(one, jnp.asarray(2.0, x.dtype),
                               list(zip(halves[0], halves[2])), halves[1])
    return jnp.concatenate(outs)
  return layer


@needs_extension
def test_pipeline_interleaves_two_micro_batches():
  """The forward's ops and joins in program order, at one rank: each micro-batch's own key; the
  second's layout and dispatch launched before the first's experts read its rows, the first's
  combine before the second's experts."""
  calls, _ = _anchors(_micro_batch_layer(_backend("local", "jax_ep")))
  short = [(t.replace("jax_ep_local_", "").replace("_own_stream", ""), k) for t, k in calls]
  assert short == [("layout", 1), ("layout", 2), ("jax_ep_join", 1), ("dispatch", 1),
                   ("jax_ep_join", 2), ("dispatch", 2), ("jax_ep_join", 1), ("combine", 1),
                   ("jax_ep_join", 2), ("combine", 2), ("jax_ep_join", 1),
                   ("jax_ep_join", 2)], short


@needs_extension
@pytest.mark.parametrize("kind", ["local", "peer"])
def test_pipeline_keys_every_op_and_join(kind):
  """Forward and backward: every op and join of the pipeline carries its micro-batch's key
  (1 or 2), never 0, and each op has a join of its key after it."""
  loss = lambda x, idx, w: jnp.sum(
      _micro_batch_layer(_backend(kind, "jax_ep"))(x, idx, w).astype(jnp.float32) ** 2)
  calls, _ = _anchors(jax.grad(loss, (0, 2)))
  assert {key for _, key in calls} == {1, 2}, calls
  for i, (target, key) in enumerate(calls):
    if target != "jax_ep_join":
      assert ("jax_ep_join", key) in calls[i + 1:], (i, calls)


def test_pipeline_matches_the_micro_batches_in_turn():
  """On the CPU (reference backend, no joins): values and gradients as the plain loop's."""
  mesh = rank_mesh(1)
  backend = jax_ep.Group(mesh, "ep", num_experts=E, num_topk=K, hidden=H,
                         max_tokens_per_rank=T, backend="reference", dtype=jnp.float32).backend

  def one(scale, part, idx):
    x, w = part
    recv_x, _, _, _, layout = primitives.dispatch(backend, x, idx, w)
    return primitives.combine(backend, jnp.tanh(recv_x * scale), layout, w), jnp.sum(idx)

  def layer(split, scale, x, idx, w):
    parts = [jnp.split(a, 2) for a in (x, idx, w)]
    if split:
      outs, aux = overlap.pipeline(one, scale, list(zip(parts[0], parts[2])), parts[1])
    else:
      outs, aux = zip(*(one(scale, (a, c), b) for a, b, c in zip(*parts)))
    return jnp.concatenate(outs), jnp.stack(aux)[None]

  def loss(split, *args):
    out, aux = jax.shard_map(functools.partial(layer, split), mesh=mesh, in_specs=P(),
                             out_specs=P("ep"))(*args)
    return jnp.sum(out ** 2), aux
  x, idx, w = _inputs()
  args = (jnp.asarray(1.5, jnp.float32), x.astype(jnp.float32), idx, w)
  grads = {split: jax.jit(jax.value_and_grad(functools.partial(loss, split), (0, 1, 3),
                                             has_aux=True))(*args) for split in (True, False)}
  for a, b in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@needs_extension
@pytest.mark.parametrize("kind", ["local", "peer"])
def test_no_stream_annotation_by_default(kind):
  ops = _lowered_ops(_programs(_backend(kind, None))["grad"])
  assert ops and all(s is None for _, s in ops), ops


@pytest.mark.parametrize("value,error,message", [
    (0, ValueError, f"comm_stream must be None .* or an int from 1 to {MAX_COMM_STREAM} .*got 0"),
    ("jax", TypeError, "comm_stream must be None .*'jax_ep' .*got 'jax'"),
    (MAX_COMM_STREAM + 1, ValueError, f"comm_stream must be .*got {MAX_COMM_STREAM + 1}"),
    (True, TypeError, "comm_stream must be None .*got True"),
    ("1", TypeError, "comm_stream must be None .*got '1'"),
])
def test_bad_comm_stream_is_named(value, error, message):
  with pytest.raises(error, match=f"jax_ep.Group: {message}"):
    jax_ep.Group(rank_mesh(2), "ep", num_experts=8, num_topk=2, hidden=64,
                 max_tokens_per_rank=4, backend="reference", comm_stream=value)


def test_the_group_keeps_its_stream(caplog):
  with caplog.at_level("INFO", logger="jax_ep"):
    group = jax_ep.Group(rank_mesh(2), "ep", num_experts=8, num_topk=2, hidden=64,
                         max_tokens_per_rank=4, backend="reference", comm_stream=2)
  assert group.options.comm_stream == 2
  assert "comm_stream=2 has no effect on the reference backend's ops" in caplog.text


def test_the_own_stream_asks_for_a_partition_of_the_budget(monkeypatch):
  monkeypatch.delenv("JAX_EP_SHARED_GPU", raising=False)
  monkeypatch.delenv(own_stream.ENV_PARTITION, raising=False)
  assert own_stream.partition_sms(24) == 24
  monkeypatch.setenv(own_stream.ENV_PARTITION, "0")  # a comparison's plain stream
  assert own_stream.partition_sms(24) == 0
  monkeypatch.delenv(own_stream.ENV_PARTITION)
  monkeypatch.setenv("JAX_EP_SHARED_GPU", "1")  # ranks sharing a GPU: kernels resident together
  assert own_stream.partition_sms(24) == 0


def test_a_partition_not_made_is_said_once(caplog, monkeypatch):
  monkeypatch.delenv("JAX_EP_SHARED_GPU", raising=False)
  monkeypatch.delenv(own_stream.ENV_PARTITION, raising=False)
  class Extension:
    def prepare_own_stream(self, device, sms):
      return (0, "the driver has no cuGreenCtxCreate (CUDA 12.4)") if sms else (0, "")
  with caplog.at_level("INFO", logger="jax_ep"):
    for _ in range(2):
      assert own_stream.prepare(Extension(), 5, 24) == 0
  assert caplog.text.count("own stream on device 5 runs on every SM, not a partition of 24: "
                           "the driver has no cuGreenCtxCreate") == 1


# ----------------------------------------------------------------------------- on the GPU

def _on_the_gpu():
  """`require_gpu()`, and the one-rank kernels loaded and jax_ep's own stream made as a `Group`
  does (these tests build the backends directly): never inside a handler."""
  require_gpu()
  ffi.extension().preload_kernels(jax.devices()[0].local_hardware_id)
  own_stream.prepare(ffi.extension(), jax.devices()[0].local_hardware_id, 24)

@pytest.mark.gpu
def test_the_own_stream_runs_on_the_partition_asked_for():
  """A green context of the budget rounded up to the driver's granularity (8 SMs on Hopper),
  never the whole GPU, where one is asked for (one process per GPU); every SM where none is
  (`JAX_EP_OWN_STREAM_PARTITION=0`, a shared GPU). The process's first own stream decides."""
  _on_the_gpu()
  got = own_stream.prepare(ffi.extension(), jax.devices()[0].local_hardware_id, 24)
  if own_stream.partition_sms(24):
    assert 24 <= got < jax.devices()[0].core_count and got % 8 == 0, got
  else:
    assert got == 0


@pytest.mark.gpu
@pytest.mark.parametrize("stream", [1, "jax_ep"])
@pytest.mark.parametrize("program", PROGRAMS)
def test_one_rank_ops_on_their_stream_match_the_compute_stream(program, stream):
  _on_the_gpu()
  outs = {}
  for s in (None, stream):
    fn = jax.jit(_programs(_backend("local", s))[program])
    outs[s] = jax.block_until_ready(fn(*_inputs()))
  for a, b in zip(jax.tree.leaves(outs[None]), jax.tree.leaves(outs[stream])):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)))


def async_homes(hlo: str) -> dict:
  """jax_ep custom call target -> [whether each of its calls sits in an async call's body] in
  an optimised HLO module (tests/hopper_aot_cases.py reads compiled programs with it too)."""
  bodies = set(re.findall(r"-start\(.*?(?:calls|to_apply)=%?([\w.\-]+)", hlo))
  homes, current = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if head:
      current = head.group(1)
    target = re.search(r'custom_call_target="(jax_ep_\w+)"', line)
    if target:
      homes.setdefault(target.group(1), []).append(current in bodies)
  return homes


@pytest.mark.gpu
def test_xla_runs_each_op_in_an_async_call():
  """What makes the ops run beside the compute stream: in the compiled program every jax_ep
  custom call sits in a computation that an async start runs (XLA's wrapper of an annotated
  op), and none does on the compute stream."""
  _on_the_gpu()
  for program in ("jit", "grad"):
    hlo = jax.jit(_programs(_backend("local", 1))[program]).lower(*_inputs()).compile().as_text()
    homes = async_homes(hlo)
    assert homes, hlo[:3000]
    for target, inside in homes.items():
      assert all(inside), (
          f"{program}: {target} outside an async call:\n"
          + "\n".join(line for line in hlo.splitlines() if "-start" in line or target in line))
    plain = jax.jit(_programs(_backend("local", None))[program]).lower(*_inputs()).compile()
    assert not any(any(inside) for inside in async_homes(plain.as_text()).values())


@pytest.mark.gpu
def test_pipeline_on_the_own_stream_matches_the_compute_stream():
  """jax_ep's pipeline of two micro-batches at one rank, its ops on jax_ep's own stream, under
  jit and grad: the compute stream's values and gradients, bit for bit."""
  _on_the_gpu()
  outs = {}
  for stream in (None, "jax_ep"):
    layer = _micro_batch_layer(_backend("local", stream))
    loss = lambda x, idx, w: jnp.sum(layer(x, idx, w).astype(jnp.float32) ** 2)
    outs[stream] = jax.block_until_ready(
        (jax.jit(layer)(*_inputs()), jax.jit(jax.grad(loss, (0, 2)))(*_inputs())))
  for a, b in zip(jax.tree.leaves(outs[None]), jax.tree.leaves(outs["jax_ep"])):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("comm_stream", [1, "jax_ep"])
def test_moe_layer_with_micro_batches_on_the_comm_stream(comm_stream):
  """The public layer, R=1, two micro-batches, on stream 1 or jax_ep's own (its pipeline):
  output and gradients equal the compute stream's, and the program's custom calls ran (no
  error from the handlers)."""
  require_gpu()
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  tokens, experts, hidden, ffn = 256, 8, 256, 256
  params = jax_ep.init_moe_params(jax.random.key(0), num_experts=experts, hidden=hidden,
                                  ffn=ffn, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (tokens, hidden), jnp.bfloat16)
  results = {}
  for stream in (None, comm_stream):
    group = jax_ep.Group(mesh, "ep", num_experts=experts, num_topk=2, hidden=hidden,
                         max_tokens_per_rank=tokens, backend="cuda", comm_stream=stream)

    def loss(params, x):
      out = jax_ep.moe_mlp(group, params, x, micro_batches=2)
      return jnp.sum(out.out.astype(jnp.float32) ** 2), out.out

    (value, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x)
    results[stream] = jax.block_until_ready((value, out, grads))
  for a, b in zip(jax.tree.leaves(results[None]), jax.tree.leaves(results[comm_stream])):
    np.testing.assert_array_equal(np.asarray(jnp.asarray(a, jnp.float32)),
                                  np.asarray(jnp.asarray(b, jnp.float32)))
