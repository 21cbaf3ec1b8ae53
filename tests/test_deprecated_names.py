"""Names deprecated for one release (CHANGELOG.md, "Deprecated"): each still works, gives what
its replacement gives, and warns naming the replacement."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import RowFormat

R, T, K, H, E = 2, 5, 2, 512, 8

# Every combination the flags allowed, and its new spelling.
OLD_AND_NEW = [
    (dict(use_fp8=False), RowFormat.PLAIN),
    (dict(use_fp8=True), RowFormat.FP8),
    (dict(use_fp8=True, round_scale=True), RowFormat.FP8_POW2_SCALES),
    (dict(use_fp8=True, round_scale=True, use_ue8m0=True), RowFormat.FP8_UE8M0),
]


def _group(hidden=H):
  mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R])
  return jax_ep.Group(mesh, "ep", num_experts=E, num_topk=K, hidden=hidden,
                      max_tokens_per_rank=T, dtype=jnp.bfloat16, backend="reference")


def _inputs(hidden=H):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(R * T, hidden)) * 3, jnp.bfloat16)
  idx = jnp.asarray(rng.integers(-1, E, size=(R * T, K)), jnp.int32)
  return x, idx


def _sharded(group, *arrays):
  return [jax.device_put(a, jax.NamedSharding(group.mesh, P("ep"))) for a in arrays]


def _run(group, op, x, idx, **kwargs):
  def body(x, idx):
    if op == "split":
      recv, _ = jax_ep.low_latency_dispatch_wait(
          group, jax_ep.low_latency_dispatch_send(group, x, idx, **kwargs))
    else:
      recv, _ = jax_ep.low_latency_dispatch(group, x, idx, **kwargs)
    return recv.x[None], (recv.scales if recv.scales is not None else recv.count)[None], \
        recv.count[None]
  return jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(P("ep"), P("ep")),
                               out_specs=P("ep")))(*_sharded(group, x, idx))


@pytest.mark.parametrize("op", ["fused", "split"])
@pytest.mark.parametrize("old,new", OLD_AND_NEW, ids=[f.name for _, f in OLD_AND_NEW])
def test_the_old_flags_give_their_row_format(op, old, new):
  group, (x, idx) = _group(), _inputs()
  with pytest.warns(DeprecationWarning, match=f"row_format=jax_ep.{new}"):
    got = _run(group, op, x, idx, **old)
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    want = _run(group, op, x, idx, row_format=new)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)))
  assert got[0].dtype == (jnp.bfloat16 if new is RowFormat.PLAIN else jnp.float8_e4m3fn)


def test_the_warning_names_the_flags_given():
  group, (x, idx) = _group(), _inputs()
  with pytest.warns(DeprecationWarning,
                    match=r"use_fp8=True, round_scale=True is deprecated.*FP8_POW2_SCALES"):
    _run(group, "fused", x, idx, use_fp8=True, round_scale=True)


def test_row_format_as_a_string():
  group, (x, idx) = _group(), _inputs()
  for spelling in ("fp8_ue8m0", "FP8_UE8M0"):
    got = _run(group, "fused", x, idx, row_format=spelling)
    want = _run(group, "fused", x, idx, row_format=RowFormat.FP8_UE8M0)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(row_format=RowFormat.FP8, use_fp8=True), TypeError,
     "pass row_format or the deprecated use_fp8, not both"),
    (dict(row_format=RowFormat.PLAIN, round_scale=False), TypeError, "not both"),
    (dict(row_format=True), TypeError, r"row_format must be a jax_ep.RowFormat \(.*"
     r"RowFormat.FP8_UE8M0\), got True of type bool"),
    (dict(row_format="fp9"), ValueError, "row_format must be one of .*, got 'fp9'"),
    (dict(round_scale=True), ValueError, "need use_fp8=True"),
    (dict(use_ue8m0=True, use_fp8=True), ValueError, "needs round_scale=True"),
])
@pytest.mark.parametrize("op", ["fused", "split"])
def test_bad_values(op, kwargs, error, message):
  group, (x, idx) = _group(), _inputs()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with pytest.raises(error, match=message):
      _run(group, op, x, idx, **kwargs)


@pytest.mark.parametrize("fmt,hidden,message", [
    (RowFormat.FP8, 64, r"row_format=RowFormat.FP8 needs hidden to be a multiple of 128.*"
                        r"hidden=64"),
    (RowFormat.FP8_UE8M0, 256, r"row_format=RowFormat.FP8_UE8M0 needs hidden to be a multiple "
                               r"of 512.*hidden=256"),
])
def test_row_format_needs_its_hidden(fmt, hidden, message):
  group, (x, idx) = _group(hidden), _inputs(hidden)
  with pytest.raises(ValueError, match=message):
    _run(group, "fused", x, idx, row_format=fmt)


def test_handle_routing_is_layout():
  group, (x, idx) = _group(), _inputs()
  w = jnp.ones(idx.shape, jnp.float32)

  def body(x, idx, w):
    _, handle = jax_ep.dispatch(group, x, idx, w)
    _, ll_handle = jax_ep.low_latency_dispatch(group, x, idx)
    with pytest.warns(DeprecationWarning, match="Handle.routing is deprecated.*Handle.layout"):
      old = handle.routing
    with pytest.warns(DeprecationWarning, match="LowLatencyHandle.routing is deprecated"):
      ll_old = ll_handle.routing
    assert old is handle.layout and ll_old is ll_handle.layout
    return x
  jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(P("ep"),) * 3,
                        out_specs=P("ep")))(*_sharded(group, x, idx, w))


def test_the_kernels_get_the_attributes_the_flags_gave():
  """The cuda backend's `(format, ue8m0)` attributes per row format: what the flags mapped to
  (`format` 2 is power-of-two scales; `ue8m0` only with it)."""
  from jax_ep.backends import cuda_ops
  want = {RowFormat.PLAIN: (0, False), RowFormat.FP8: (1, False),
          RowFormat.FP8_POW2_SCALES: (2, False), RowFormat.FP8_UE8M0: (2, True)}
  assert {fmt: cuda_ops.low_latency_format(fmt) for fmt in RowFormat} == want


MEMORY = dict(num_ranks=R, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)


@pytest.mark.parametrize("use_fp8,fmt", [(True, RowFormat.FP8), (False, RowFormat.PLAIN)])
def test_memory_bytes_use_fp8_is_its_row_format(use_fp8, fmt):
  """`memory_bytes(use_fp8=...)` and the group's (by keyword, or a bool in `row_format`'s place,
  the old positional form) size what `row_format` sizes, warning at the caller's line."""
  group = _group()
  calls = [("jax_ep.memory_bytes", lambda **kw: jax_ep.memory_bytes(**MEMORY, **kw),
            lambda: jax_ep.memory_bytes(**MEMORY, use_fp8=use_fp8)),
           ("jax_ep.Group.memory_bytes", group.memory_bytes,
            lambda: group.memory_bytes(use_fp8=use_fp8)),
           ("jax_ep.Group.memory_bytes", group.memory_bytes, lambda: group.memory_bytes(use_fp8))]
  for where, new, old in calls:
    with pytest.warns(DeprecationWarning,
                      match=f"{where}: use_fp8={use_fp8} is deprecated .* pass "
                            f"row_format=jax_ep.{fmt} instead") as record:
      got = old()
    assert [w.filename for w in record] == [__file__]
    with warnings.catch_warnings():
      warnings.simplefilter("error", DeprecationWarning)
      assert got == new(row_format=fmt)


def test_memory_bytes_row_format_values():
  for spelling in ("fp8_ue8m0", "FP8_UE8M0", RowFormat.FP8_UE8M0):
    est = jax_ep.memory_bytes(**MEMORY, row_format=spelling)
    assert est.low_latency_recv_bytes == (E // R) * R * T * (H + H // 512 * 4)
  with pytest.raises(TypeError, match="pass row_format or the deprecated use_fp8, not both"):
    jax_ep.memory_bytes(**MEMORY, row_format=RowFormat.FP8, use_fp8=True)
  with pytest.raises(TypeError, match="pass row_format or the deprecated use_fp8, not both"):
    _group().memory_bytes(True, use_fp8=True)
  with pytest.raises(ValueError, match=r"jax_ep.memory_bytes: row_format must be one of .*, "
                                       r"got 'fp9'"):
    jax_ep.memory_bytes(**MEMORY, row_format="fp9")
