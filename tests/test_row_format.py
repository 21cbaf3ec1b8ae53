"""`jax_ep.RowFormat`, the low-latency rows' format: how callers may spell it, what it needs of
the group, what the kernels are told, and what `memory_bytes` sizes for it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import RowFormat

R, T, K, H, E = 2, 5, 2, 512, 8


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


def test_row_format_as_a_string():
  group, (x, idx) = _group(), _inputs()
  for spelling in ("fp8_ue8m0", "FP8_UE8M0"):
    got = _run(group, "fused", x, idx, row_format=spelling)
    want = _run(group, "fused", x, idx, row_format=RowFormat.FP8_UE8M0)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(use_fp8=True), TypeError, "unexpected keyword argument 'use_fp8'"),
    (dict(row_format=True), TypeError, r"row_format must be a jax_ep.RowFormat \(.*"
     r"RowFormat.FP8_UE8M0\), got True of type bool"),
    (dict(row_format="fp9"), ValueError, "row_format must be one of .*, got 'fp9'"),
])
@pytest.mark.parametrize("op", ["fused", "split"])
def test_bad_values(op, kwargs, error, message):
  group, (x, idx) = _group(), _inputs()
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


def test_the_kernels_get_the_attributes_the_flags_gave():
  """The cuda backend's `(format, ue8m0)` attributes per row format (`format` 2 is
  power-of-two scales; `ue8m0` only with it)."""
  from jax_ep.backends import cuda_ops
  want = {RowFormat.PLAIN: (0, False), RowFormat.FP8: (1, False),
          RowFormat.FP8_POW2_SCALES: (2, False), RowFormat.FP8_UE8M0: (2, True)}
  assert {fmt: cuda_ops.low_latency_format(fmt) for fmt in RowFormat} == want


MEMORY = dict(num_ranks=R, num_experts=E, num_topk=K, hidden=H, max_tokens_per_rank=T)


def test_memory_bytes_row_format_values():
  for spelling in ("fp8_ue8m0", "FP8_UE8M0", RowFormat.FP8_UE8M0):
    est = jax_ep.memory_bytes(**MEMORY, row_format=spelling)
    assert est.low_latency_recv_bytes == (E // R) * R * T * (H + H // 512 * 4)
  assert _group().memory_bytes("fp8_ue8m0") == _group().memory_bytes(RowFormat.FP8_UE8M0)
  with pytest.raises(TypeError, match="row_format must be a jax_ep.RowFormat"):
    _group().memory_bytes(True)
  with pytest.raises(ValueError, match=r"jax_ep.memory_bytes: row_format must be one of .*, "
                                       r"got 'fp9'"):
    jax_ep.memory_bytes(**MEMORY, row_format="fp9")
