"""Capacity as a knob: `capacity` and `buffer_factor` in rows, their errors, the drops a small
capacity causes, and `memory_bytes`' report of what the expert layer keeps for its backward,
against a hand count and against the residuals jax itself saves (reference backend, CPU)."""

import fractions
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_test_base import host_value, local_rank_mask, rank_mesh
from jax_ep import layer, sizing
from jax_ep.gmm import ROW_TILE, grouped_matmul
from jax_ep.testing import oracle

REPO = pathlib.Path(__file__).resolve().parents[1]


def _group(ranks=2, **overrides):
  kwargs = dict(num_experts=8, num_topk=2, hidden=64, max_tokens_per_rank=16,
                dtype=jnp.float32, backend="reference")
  kwargs.update(overrides)
  return jax_ep.Group(rank_mesh(ranks), "ep", **kwargs)


def _rows_for_factor(f, r, t, k, num_local):
  """The rule, spelled out: ceil(f * T_max * K) in exact decimal arithmetic, up to whole row
  tiles, at most the worst case R * T_max * min(K, L)."""
  rows = math.ceil(fractions.Fraction(str(f)) * t * k)
  return min(-(-rows // ROW_TILE) * ROW_TILE, r * t * min(k, num_local))


# ------------------------------------------------------------------ buffer_factor in rows

@pytest.mark.parametrize("f,r,t,k,e,rows", [
    (1.25, 8, 4096, 8, 256, 40960),   # DeepSeek-V3 at 8 ranks: 1.25 * 4096 * 8, whole tiles
    (1.0, 4, 100, 3, 16, 384),        # 300 rows, up to three tiles
    (1.28, 4, 100, 1, 8, 128),        # 1.28 * 100 is 128 exactly, not the float 128.00000000000003
    (0.01, 2, 1000, 2, 8, 128),       # 20 rows: one whole tile
    (1.0, 2, 16, 2, 8, 64),           # a tile is more than the worst case 2 * 16 * 2: clamped
    (2.0, 4, 64, 8, 8, 512),          # L = 2 < K: the worst case is 4 * 64 * min(8, 2) = 512
    (1.5, 1, 333, 4, 4, 1332),        # 1998 rows, 2048 in tiles: past the worst case 1 * 333 * 4
])
def test_buffer_factor_rows(f, r, t, k, e, rows):
  assert _rows_for_factor(f, r, t, k, e // r) == rows
  assert jax_ep.capacity_from_buffer_factor(f, r, t, k, e // r) == rows
  est = jax_ep.memory_bytes(num_ranks=r, num_experts=e, num_topk=k, hidden=128,
                            max_tokens_per_rank=t, buffer_factor=f)
  assert est.capacity == rows and est.recv_x_bytes == rows * 128 * 2
  if r <= 8:
    group = jax_ep.Group(rank_mesh(r), "ep", num_experts=e, num_topk=k, hidden=128,
                         max_tokens_per_rank=t, buffer_factor=f, backend="reference")
    assert group.capacity == group.config.capacity == rows
    assert group.buffer_factor == group.config.buffer_factor == f


def test_buffer_factor_is_part_of_the_groups_configuration():
  group = _group(num_topk=2, max_tokens_per_rank=256, buffer_factor=0.75)
  assert group.capacity == 384  # 0.75 * 256 * 2
  assert "capacity=384, buffer_factor=0.75," in repr(group)
  # Every process must agree on the rows; the factor that gave them builds the same buffers.
  assert group.config.fingerprint()["capacity"] == 384
  assert "buffer_factor" not in group.config.fingerprint()
  same_rows = _group(num_topk=2, max_tokens_per_rank=256, capacity=384)
  assert same_rows.config == group.config and same_rows.buffer_factor is None
  assert "buffer_factor" not in repr(same_rows)
  assert _group().buffer_factor is None
  assert group.memory_bytes().capacity == 384


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(capacity=64, buffer_factor=1.0), ValueError,
     r"pass capacity or buffer_factor, not both \(got capacity=64, buffer_factor=1.0\)"),
    (dict(buffer_factor=0), ValueError, "buffer_factor must be a positive finite number, got 0"),
    (dict(buffer_factor=-1.5), ValueError, "buffer_factor must be a positive finite number, got -1.5"),
    (dict(buffer_factor=float("nan")), ValueError,
     "buffer_factor must be a positive finite number, got nan"),
    (dict(buffer_factor=float("inf")), ValueError,
     "buffer_factor must be a positive finite number, got inf"),
    (dict(buffer_factor="1.25"), TypeError,
     r"buffer_factor must be a positive finite number, got '1.25' \(str\)"),
    (dict(buffer_factor=True), TypeError,
     r"buffer_factor must be a positive finite number, got True \(bool\)"),
    (dict(capacity=0), ValueError, "capacity must be positive, got 0"),
    (dict(capacity=2.5), TypeError, r"capacity must be an int \(rows\), got 2.5 \(float\)"),
])
def test_bad_capacity_arguments_are_named(kwargs, error, message):
  with pytest.raises(error, match="jax_ep.Group: " + message):
    _group(**kwargs)
  with pytest.raises(error, match="jax_ep.memory_bytes: " + message):
    jax_ep.memory_bytes(num_ranks=2, num_experts=8, num_topk=2, hidden=64,
                        max_tokens_per_rank=16, **kwargs)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(ffn=0), ValueError, "ffn must be positive, got 0"),
    (dict(ffn=2.5), TypeError, r"ffn must be an int, got 2.5"),
    (dict(ffn=64, activation="relu"), ValueError,
     "activation must be one of 'swiglu', 'geglu', 'gelu', 'silu'; got 'relu'"),
])
def test_bad_memory_arguments_are_named(kwargs, error, message):
  with pytest.raises(error, match="jax_ep.memory_bytes: " + message):
    jax_ep.memory_bytes(num_ranks=2, num_experts=8, num_topk=2, hidden=64,
                        max_tokens_per_rank=16, **kwargs)


# ------------------------------------------------------------------ expert_alignment

@pytest.mark.parametrize("kwargs,rows", [
    # L = 4 local experts, A = 16: the worst case grows by L * (A - 1) = 60 rows.
    (dict(), 2 * 16 * 2 + 60),
    (dict(capacity=40), 40),  # rows given: the user's, padding or not
    # ceil(0.5 * 16 * 2) + 60 = 76 rows, up to one tile (128), clamped to the worst case 124.
    (dict(buffer_factor=0.5), 2 * 16 * 2 + 60),
])
def test_expert_alignment_grows_the_default_and_factor_capacities(kwargs, rows):
  group = _group(expert_alignment=16, **kwargs)
  assert group.expert_alignment == group.config.expert_alignment == 16
  assert group.capacity == rows
  assert "expert_alignment=16" in repr(group) and "expert_alignment" not in repr(_group())
  assert group.config.fingerprint()["expert_alignment"] == 16
  assert group.config != _group(capacity=rows).config  # another layout of the rows
  est = jax_ep.memory_bytes(num_ranks=2, num_experts=8, num_topk=2, hidden=64,
                            max_tokens_per_rank=16, expert_alignment=16, **kwargs)
  assert est.capacity == rows and est.recv_x_bytes == rows * 64 * 2
  assert group.memory_bytes().capacity == rows


@pytest.mark.parametrize("f,r,t,k,e,a,rows", [
    (1.25, 8, 4096, 8, 256, 128, 45056),  # 40960 + 32 * 127 = 45024 rows, up to whole tiles
    (1.0, 1, 4096, 8, 256, 128, 65280),   # one rank: 32768 + 256 * 127, the worst case itself
    (1.0, 4, 100, 3, 16, 1, 384),                # A = 1: as without it
])
def test_capacity_from_buffer_factor_with_alignment(f, r, t, k, e, a, rows):
  assert jax_ep.capacity_from_buffer_factor(f, r, t, k, e // r, a) == rows
  assert jax_ep.default_capacity(r, t, k, e // r, a) == r * t * min(k, e // r) + e // r * (a - 1)


@pytest.mark.parametrize("value,error,message", [
    (0, ValueError, r"expert_alignment must be an int in \[1, 65536\] .*got 0"),
    (-8, ValueError, r"expert_alignment must be an int in \[1, 65536\] .*got -8"),
    (1 << 17, ValueError, r"expert_alignment must be an int in \[1, 65536\] .*got 131072"),
    (8.0, TypeError, r"expert_alignment must be a positive int \(rows\), got 8.0 \(float\)"),
    ("128", TypeError, r"expert_alignment must be a positive int \(rows\), got '128' \(str\)"),
    (True, TypeError, r"expert_alignment must be a positive int \(rows\), got True"),
])
def test_bad_expert_alignment_is_named(value, error, message):
  with pytest.raises(error, match="jax_ep.Group: " + message):
    _group(expert_alignment=value)
  with pytest.raises(error, match="jax_ep.memory_bytes: " + message):
    jax_ep.memory_bytes(num_ranks=2, num_experts=8, num_topk=2, hidden=64,
                        max_tokens_per_rank=16, expert_alignment=value)


# ------------------------------------------------------------------ drops at a smaller capacity

def _balanced_or_skewed(r, t, k, e, skewed):
  """Balanced: token j of every rank picks the K experts of rank j % R (each rank receives
  exactly T * K rows). Skewed: every token picks rank 0's first K experts."""
  num_local = e // r
  idx = np.zeros((r, t, k), np.int32)
  for s in range(r):
    for j in range(t):
      dst = 0 if skewed else j % r
      idx[s, j] = dst * num_local + np.arange(k)
  return idx


@pytest.mark.parametrize("factor,skewed", [(1.0, False), (0.5, False), (1.0, True)])
@pytest.mark.parametrize("strict", [False, True])
def test_buffer_factor_drops_are_counted_and_strict_raises(factor, skewed, strict):
  """At buffer_factor=1 a perfectly balanced step fits exactly; half of it drops half of
  every rank's rows; a skewed step drops what does not fit rank 0. Drops match the oracle
  (the first `capacity` rows in contract order are kept), dropped rows add nothing to combine,
  and a strict group raises CapacityOverflowError from check()."""
  r, t, k, e, h = 2, 128, 2, 8, 16
  group = _group(ranks=r, num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
                 buffer_factor=factor, strict=strict)
  assert group.capacity == int(factor * t * k)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((r, t, h)).astype(np.float32)
  idx = _balanced_or_skewed(r, t, k, e, skewed)
  w = rng.random((r, t, k)).astype(np.float32)
  eo = rng.standard_normal((r, group.capacity, h)).astype(np.float32)

  def body(x, idx, w, eo):
    recv, handle = jax_ep.dispatch(group, x[0], idx[0], w[0])
    return recv.num_dropped[None], jax_ep.combine(group, eo[0], handle)[None]
  sharding = jax.NamedSharding(group.mesh, P("ep"))
  step = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=P("ep"), out_specs=P("ep")))
  dropped, out = (host_value(v) for v in step(*(jax.device_put(a, sharding)
                                                for a in (x, idx, w, eo))))
  expected = oracle.dispatch(x, idx, e, group.capacity)
  want_dropped = [int(d["num_dropped"]) for d in expected]
  if not skewed:
    assert want_dropped == [0, 0] if factor == 1.0 else want_dropped == [t * k // 2] * r
  else:
    assert want_dropped == [r * t * k - group.capacity, 0]
  mine = local_rank_mask(group.mesh)
  np.testing.assert_array_equal(dropped[mine], np.array(want_dropped)[mine])
  want = oracle.combine(list(eo), expected, w, np.float64)
  np.testing.assert_allclose(out[mine], want[mine], rtol=1e-5, atol=1e-5)
  if strict and sum(want_dropped):
    with pytest.raises(jax_ep.CapacityOverflowError,
                       match=rf"did not fit in capacity={group.capacity} "):
      group.check()
  else:
    group.check()
  group.close()


# ------------------------------------------------------------------ the memory report

R, E, K, H, F, T = 8, 256, 8, 7168, 2048, 4096  # DeepSeek-V3 at 8 ranks x 4096 tokens


@pytest.mark.parametrize("buffer_factor,capacity", [(None, R * T * K), (1.25, 40960)])
def test_expert_activation_bytes_by_hand(buffer_factor, capacity):
  """SwiGLU, bf16, counted by hand from jax_ep/layer.py's `expert_mlp` and the custom_vjp
  residuals of dispatch, `grouped_matmul` and combine."""
  est = jax_ep.memory_bytes(num_ranks=R, num_experts=E, num_topk=K, hidden=H,
                            max_tokens_per_rank=T, buffer_factor=buffer_factor, ffn=F)
  assert est.capacity == capacity
  c, bf16, f32, i32 = capacity, 2, 4, 4
  layer_input = T * H * bf16                          # dispatch keeps x
  routing = (i32 * (T * K + R * T * K + c)            # the handle's metadata
             + f32 * T * K                            # the merged weights combine keeps
             + T * K * K * (1 + f32) + T * K * (1 + 1 + f32))  # the duplicate-slot merge's masks
  rows = c * H * bf16 + 2 * i32 * (E // R)   # gate/up GEMMs' (x, group_sizes, group_offsets)
  products = 5 * c * F * f32                          # gate, up, silu, sigmoid, sigmoid'
  hidden_act = c * F * bf16                           # the down GEMM's x
  expert_out = c * H * bf16                           # combine keeps it for the weights' grad
  assert est.expert_activation_bytes == (layer_input + routing + rows + products + hidden_act
                                         + expert_out)
  assert est.expert_activation_bytes_remat == layer_input + T * K * (i32 + f32)
  assert est.total_bytes == (est.recv_x_bytes + est.handle_bytes + est.low_latency_recv_bytes
                             + est.workspace_bytes + est.comm_buffer_bytes)


def test_no_ffn_no_activation_report():
  est = jax_ep.memory_bytes(num_ranks=2, num_experts=8, num_topk=2, hidden=64,
                            max_tokens_per_rank=16)
  assert est.expert_activation_bytes is None and est.expert_activation_bytes_remat is None
  from jax_ep.group import MemoryEstimate, memory_bytes  # the old import path still works
  assert memory_bytes is jax_ep.memory_bytes and MemoryEstimate is jax_ep.MemoryEstimate


def _residual_bytes(fn, *args, exclude=()):
  """Bytes of what `jax.vjp(fn, *args)` keeps for the backward (its residuals, the arrays the
  returned function closes over), leaving out leaves shaped like `exclude` (the weights); and
  how many were left out. Traced only (`jax.eval_shape`): the residuals' shapes are the point,
  and running the layer op by op would take the CPU half a minute."""
  residuals = jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]), *args)
  skip = {(tuple(a.shape), np.dtype(a.dtype)) for a in exclude}
  total = left_out = 0
  for leaf in residuals:
    if (tuple(leaf.shape), np.dtype(leaf.dtype)) in skip:
      left_out += 1
      continue
    total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
  return total, left_out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("buffer_factor", [None, 1.0])
def test_expert_activation_bytes_are_what_jax_saves(dtype, buffer_factor):
  """`jax.vjp` of `jax_ep.moe_mlp` on the reference backend: the residuals it keeps, weights
  aside, are `expert_activation_bytes` per rank; inside `jax.checkpoint`, the remat figure."""
  r, e, k, h, f, t = 2, 8, 2, 64, 96, 128
  group = _group(ranks=r, num_experts=e, num_topk=k, hidden=h, max_tokens_per_rank=t,
                 dtype=dtype, buffer_factor=buffer_factor)
  assert group.capacity == (r * t * k if buffer_factor is None else 256)
  params = jax_ep.init_moe_params(jax.random.key(0), num_experts=e, hidden=h, ffn=f,
                                  dtype=dtype)
  x = jax.random.normal(jax.random.key(1), (r * t, h)).astype(dtype)
  idx = jax.random.randint(jax.random.key(2), (r * t, k), 0, e, jnp.int32)
  w = jax.random.uniform(jax.random.key(3), (r * t, k))
  weights = (params.w_gate, params.w_up, params.w_down)

  def moe(params, x, idx, w):
    return jax_ep.moe_mlp(group, params, x, idx, w).out

  est = group.memory_bytes(ffn=f)
  saved, left_out = _residual_bytes(moe, params, x, idx, w, exclude=weights)
  assert left_out == 3  # the three expert weights, and nothing else of their shapes
  assert saved == r * est.expert_activation_bytes  # every rank's residuals, side by side
  saved, left_out = _residual_bytes(jax.checkpoint(moe), params, x, idx, w, exclude=weights)
  assert left_out == 3
  assert saved == r * est.expert_activation_bytes_remat


def _expert_ffn(activation):
  """`layer.expert_mlp` with another activation (gated: act(gate) * up; plain: act(up))."""
  fn, gated = sizing.ACTIVATIONS[activation]

  def ffn(x, w_gate, w_up, w_down, group_sizes):
    f32 = jnp.float32
    offsets = jnp.cumsum(group_sizes) - group_sizes  # once, as expert_mlp does
    up = grouped_matmul(x, w_up, group_sizes, group_offsets=offsets, preferred_element_type=f32)
    if gated:
      gate = grouped_matmul(x, w_gate, group_sizes, group_offsets=offsets,
                            preferred_element_type=f32)
      h = (fn(gate) * up).astype(x.dtype)
    else:
      h = fn(up).astype(x.dtype)
    return grouped_matmul(h, w_down, group_sizes, group_offsets=offsets,
                          preferred_element_type=f32).astype(x.dtype)
  return ffn


@pytest.mark.parametrize("activation", ["geglu", "gelu", "silu"])
def test_other_activations_differ_from_swiglu_as_jax_says(activation):
  """The expert FFN is the only part that depends on the activation: what changes in the
  report equals what changes in jax's residuals between `layer.expert_mlp` (swiglu) and the
  same FFN with `activation`."""
  rows, h, f, num_local = 256, 64, 96, 4
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
  w_gate, w_up = (jnp.asarray(rng.standard_normal((num_local, h, f)), jnp.bfloat16)
                  for _ in range(2))
  w_down = jnp.asarray(rng.standard_normal((num_local, f, h)), jnp.bfloat16)
  sizes = jnp.asarray([100, 0, 60, 50], jnp.int32)
  weights = (w_gate, w_down)  # w_up has w_gate's shape

  def saved(fn):
    return _residual_bytes(lambda x, *w: fn(x, *w, sizes), x, w_gate, w_up, w_down,
                           exclude=weights)[0]
  kw = dict(num_ranks=2, num_experts=8, num_topk=2, hidden=h, max_tokens_per_rank=64,
            capacity=rows, ffn=f)
  report = (jax_ep.memory_bytes(**kw, activation=activation).expert_activation_bytes
            - jax_ep.memory_bytes(**kw).expert_activation_bytes)
  assert report == saved(_expert_ffn(activation)) - saved(layer.expert_mlp)
  assert saved(_expert_ffn("swiglu")) == saved(layer.expert_mlp)  # the mirror is faithful


# ------------------------------------------------------------------ docs/memory.md

def test_the_deepseek_table_in_docs_is_what_memory_bytes_prints(capsys):
  """docs/memory.md shows the call that prints its table; running it prints that table."""
  text = (REPO / "docs" / "memory.md").read_text()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  exec(compile(code, "docs/memory.md", "exec"), {})
  printed = capsys.readouterr().out.strip()
  assert len(printed.splitlines()) == 4  # header, rule, the default and buffer_factor=1.25
  assert "\n" + printed + "\n" in text
