"""The high-throughput ops across hosts (jax_ep/backends/hierarchical.py) against the oracle, on
the CPU.

The composition (rail exchange to the same local index on each host, the host's own dispatch
of the forwarded blocks with each expert numbered once per source host, which gives the whole
group's row order, and the reverse path of combine and of the gradients) runs with the
reference backend over each host's ranks and the reference rail exchange, on a two-axis mesh
of host devices (`hosts` x `gpus`, rank = host * G + gpu).
The cuda backend runs the same code with its kernels (tests/test_cuda_network.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep.backends import hierarchical, primitives
from jax_ep.backends import ReferenceBackend
from jax_ep.config import EPConfig, RowFormat, default_capacity
from jax_ep.ops import merge_duplicate_slots
from jax_ep.testing import oracle
from ep_test_base import assert_close, make_routing, random_inputs

AXES = ("hosts", "gpus")


def _host_index():
  return jax.lax.axis_index("hosts")


def _make(num_hosts, gpus, *, num_experts, num_topk, hidden, max_tokens, dtype, capacity=None,
          wire_format=RowFormat.PLAIN):
  r = num_hosts * gpus
  if r > len(jax.devices()):
    pytest.skip(f"needs {r} devices")
  num_local = num_experts // r
  if capacity is None:
    capacity = default_capacity(r, max_tokens, num_topk, num_local)
  config = EPConfig("ep", r, num_experts, num_topk, hidden, max_tokens, np.dtype(dtype),
                    capacity, wire_format=wire_format)
  hosts = tuple(tuple(range(h * gpus, (h + 1) * gpus)) for h in range(num_hosts))
  backend = hierarchical.Hierarchy(
      config, hosts, ReferenceBackend(hierarchical.host_config(config, num_hosts, "gpus")),
      hierarchical.reference_rail_exchange("hosts"), _host_index)
  mesh = jax.make_mesh((num_hosts, gpus), AXES, devices=jax.devices()[:r])
  return backend, mesh


def _run(mesh, fn, *arrays):
  spec = P(AXES)

  def body(*blocks):
    return jax.tree.map(lambda o: o[None], fn(*(b[0] for b in blocks)))

  sharding = NamedSharding(mesh, spec)
  placed = [jax.device_put(a, sharding) for a in arrays]
  outs = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(*placed)
  return jax.tree.map(np.asarray, outs)


def _dispatch_combine(backend, mesh, x, idx, w, eo, weighted=True):
  num_experts = backend.config.num_experts

  def fn(x, idx, w, eo):
    idx, w = merge_duplicate_slots(idx, w, num_experts)
    recv_x, sizes, dropped, invalid, routing = primitives.dispatch(backend, x, idx, w)
    if weighted:
      out = primitives.combine(backend, eo, routing, w)
    else:
      out = primitives.combine(backend, eo, routing)
    return recv_x, sizes, dropped, invalid, out
  return _run(mesh, fn, x, idx, w, eo)


@pytest.mark.ranks("num_hosts,gpus", [(2, 4), (4, 2), (2, 1), (8, 1)],
                   count=lambda h, g: h * g)
@pytest.mark.parametrize("pattern", ["uniform", "hot", "duplicates", "invalid", "all_masked",
                                     "unused_experts"])
def test_dispatch_and_combine_match_the_oracle(num_hosts, gpus, pattern):
  r = num_hosts * gpus
  num_experts, num_topk, hidden, tokens = 4 * r, 4, 64, 13
  backend, mesh = _make(num_hosts, gpus, num_experts=num_experts, num_topk=num_topk,
                        hidden=hidden, max_tokens=tokens, dtype=jnp.float32)
  rng = np.random.default_rng(7)
  x = random_inputs(rng, r, tokens, hidden, jnp.float32)
  idx = make_routing(rng, r, tokens, num_topk, num_experts, pattern)
  w = rng.random((r, tokens, num_topk)).astype(np.float32)
  capacity = backend.config.capacity
  eo = random_inputs(rng, r, capacity, hidden, jnp.float32)
  recv_x, sizes, dropped, invalid, out = _dispatch_combine(backend, mesh, x, idx, w, eo)
  expected = oracle.dispatch(x, idx, num_experts, capacity)
  for d, want in enumerate(expected):
    np.testing.assert_array_equal(recv_x[d], want["recv_x"], err_msg=f"recv_x on rank {d}")
    np.testing.assert_array_equal(sizes[d], want["group_sizes"], err_msg=f"rank {d}")
    assert dropped[d] == want["num_dropped"]
  np.testing.assert_array_equal(invalid, oracle.num_invalid(idx, num_experts))
  want = oracle.combine(list(eo), expected, w, np.float64)
  assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.ranks("num_hosts,gpus", [(2, 2), (2, 1)], count=lambda h, g: h * g)
@pytest.mark.parametrize("fmt", [RowFormat.FP8, RowFormat.FP8_POW2_SCALES, RowFormat.FP8_UE8M0],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("given", [False, True], ids=["quantised_here", "given"])
def test_fp8_dispatch_across_hosts_is_the_closed_form(num_hosts, gpus, fmt, given):
  """Each token quantised once on its own rank (or passed as e4m3 rows with their scales), its
  e4m3 row and scales sent over the rail, then placed by the host group's fp8 dispatch: rows
  and scales bit-exact against the oracle's closed form, drops and counts the oracle's, and
  the combine of the rows takes the same layout as the plain dispatch's."""
  r = num_hosts * gpus
  num_experts, num_topk, hidden, tokens = 4 * r, 3, 512, 9
  backend, mesh = _make(num_hosts, gpus, num_experts=num_experts, num_topk=num_topk,
                        hidden=hidden, max_tokens=tokens, dtype=jnp.bfloat16, capacity=12,
                        wire_format=fmt)
  rng = np.random.default_rng(11)
  x = random_inputs(rng, r, tokens, hidden, jnp.bfloat16).copy()
  x[..., :128] = 0  # an all-zero block: scale 1
  idx = make_routing(rng, r, tokens, num_topk, num_experts, "hot")
  w = rng.random((r, tokens, num_topk)).astype(np.float32)
  q, scales = oracle.fp8_quantize(x, round_scale=fmt.pow2_scales)
  q = q.astype(jnp.float8_e4m3fn)
  if fmt.ue8m0:
    scales = oracle.pack_ue8m0(scales)

  def fn(x, q, scales, idx, w):
    idx, w = merge_duplicate_slots(idx, w, num_experts)
    rows, x_scales = (q, scales) if given else (x, None)
    recv_x, recv_s, sizes, dropped, invalid, routing = primitives.dispatch_fp8(
        backend, rows, x_scales, idx, w)
    deq = primitives.dequantize(recv_x, recv_s, jnp.float32)
    return recv_x, recv_s, sizes, dropped, invalid, primitives.combine(backend, deq, routing)
  recv_x, recv_s, sizes, dropped, invalid, out = _run(mesh, fn, x, q, scales, idx, w)
  expected = oracle.fp8_dispatch(x, idx, num_experts, 12, round_scale=fmt.pow2_scales,
                                 ue8m0=fmt.ue8m0)
  assert sum(int(e["num_dropped"]) for e in expected) > 0
  for d, want in enumerate(expected):
    n = int(want["group_sizes"].sum())
    np.testing.assert_array_equal(sizes[d], want["group_sizes"], err_msg=f"rank {d}")
    assert dropped[d] == want["num_dropped"]
    np.testing.assert_array_equal(recv_x[d][:n].astype(np.float32),
                                  want["recv_x"][:n].astype(np.float32),
                                  err_msg=f"recv_x on rank {d}")
    np.testing.assert_array_equal(recv_s[d][:n], want["scales"][:n],
                                  err_msg=f"scales on rank {d}")
  np.testing.assert_array_equal(invalid, oracle.num_invalid(idx, num_experts))
  # The unweighted combine of the dequantised rows: each token's dequantised value, once per
  # row of it kept (its transpose of the dispatch).
  q32, token_scales = expected[0]["q"].astype(np.float64), expected[0]["token_scales"]
  deq = q32 * np.repeat(np.asarray(token_scales, np.float64), 128, axis=-1)
  placed = [e["recv_x"] for e in oracle.dispatch(deq, idx, num_experts, 12)]
  want = oracle.combine(placed, expected, w, np.float64, weighted=False)
  assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("capacity", [0, 7, 40])
def test_capacity_drops_the_rows_past_it_in_the_whole_groups_order(capacity):
  """Drops are decided after the merge: the rows kept are the first `capacity` of the
  contract's order over every source, not of any one host's."""
  num_hosts, gpus = 2, 2
  r = num_hosts * gpus
  num_experts, num_topk, hidden, tokens = 2 * r, 3, 32, 11
  backend, mesh = _make(num_hosts, gpus, num_experts=num_experts, num_topk=num_topk,
                        hidden=hidden, max_tokens=tokens, dtype=jnp.float32, capacity=capacity)
  rng = np.random.default_rng(3)
  x = random_inputs(rng, r, tokens, hidden, jnp.float32)
  idx = make_routing(rng, r, tokens, num_topk, num_experts, "hot")
  w = rng.random((r, tokens, num_topk)).astype(np.float32)
  eo = random_inputs(rng, r, capacity, hidden, jnp.float32)
  recv_x, sizes, dropped, _, out = _dispatch_combine(backend, mesh, x, idx, w, eo)
  expected = oracle.dispatch(x, idx, num_experts, capacity)
  assert sum(int(e["num_dropped"]) for e in expected) > 0
  for d, want in enumerate(expected):
    np.testing.assert_array_equal(recv_x[d], want["recv_x"])
    np.testing.assert_array_equal(sizes[d], want["group_sizes"])
    assert dropped[d] == want["num_dropped"]
  assert_close(out, oracle.combine(list(eo), expected, w, np.float64), rtol=1e-5, atol=1e-5)


def test_unweighted_combine_and_bf16():
  num_hosts, gpus = 2, 4
  r = num_hosts * gpus
  num_experts, num_topk, hidden, tokens = 2 * r, 4, 128, 9
  backend, mesh = _make(num_hosts, gpus, num_experts=num_experts, num_topk=num_topk,
                        hidden=hidden, max_tokens=tokens, dtype=jnp.bfloat16)
  rng = np.random.default_rng(5)
  x = random_inputs(rng, r, tokens, hidden, jnp.bfloat16)
  idx = make_routing(rng, r, tokens, num_topk, num_experts, "duplicates")
  w = rng.random((r, tokens, num_topk)).astype(np.float32)
  eo = random_inputs(rng, r, backend.config.capacity, hidden, jnp.bfloat16)
  recv_x, _, _, _, out = _dispatch_combine(backend, mesh, x, idx, w, eo, weighted=False)
  expected = oracle.dispatch(x, idx, num_experts, backend.config.capacity)
  for d, want in enumerate(expected):
    np.testing.assert_array_equal(recv_x[d], want["recv_x"])
  want = oracle.combine(list(eo), expected, w, np.float64, weighted=False)
  # One bf16 rounding of each host's partial, then of the sum.
  bound = 2.0 ** -8 * oracle.combine([np.abs(np.asarray(e, np.float64)) for e in eo], expected,
                                     w, np.float64, weighted=False)
  assert_close(out, want, rtol=1.6e-2, atol=1.6e-2 + bound)


@pytest.mark.ranks("num_hosts,gpus,pattern", [(2, 4, "uniform"), (4, 2, "invalid"),
                                              (2, 2, "duplicates")], count=lambda h, g, _: h * g)
def test_gradients_match_the_dense_model(num_hosts, gpus, pattern):
  """jax.grad through dispatch -> per-expert scale -> weighted combine: the backward ops
  (the cached weighted dispatch, combine's dots, the unweighted combine) go through the rail
  exchange and the host groups too."""
  r = num_hosts * gpus
  num_experts, num_topk, hidden, tokens = 2 * r, 4, 64, 10
  backend, mesh = _make(num_hosts, gpus, num_experts=num_experts, num_topk=num_topk,
                        hidden=hidden, max_tokens=tokens, dtype=jnp.float32)
  rng = np.random.default_rng(11)
  x = random_inputs(rng, r, tokens, hidden, jnp.float32)
  idx = make_routing(rng, r, tokens, num_topk, num_experts, pattern)
  w = rng.random((r, tokens, num_topk)).astype(np.float32)
  a = rng.standard_normal((r, num_experts // r, hidden)).astype(np.float32)
  cot = rng.standard_normal((r, tokens, hidden)).astype(np.float32)
  capacity = backend.config.capacity

  def fn(x, idx, w, a, cot):
    def loss(x, w, a):
      merged_idx, merged_w = merge_duplicate_slots(idx, w, num_experts)
      recv_x, sizes, _, _, routing = primitives.dispatch(backend, x, merged_idx,
                                                                merged_w)
      expert = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(capacity), side="right")
      scale = a[jnp.minimum(expert, a.shape[0] - 1)]
      expert_out = recv_x * scale
      out = primitives.combine(backend, expert_out, routing, merged_w)
      return jnp.sum(out * cot)
    return jax.grad(loss, argnums=(0, 1, 2))(x, w, a)

  gx, gw, ga = _run(mesh, fn, x, idx, w, a, cot)

  def dense(x, w, a):
    valid = (idx >= 0) & (idx < num_experts)
    scales = a.reshape(num_experts, hidden)[np.clip(idx, 0, num_experts - 1)]
    terms = jnp.where(valid[..., None], w[..., None] * scales, 0.0)
    return jnp.sum(x * jnp.sum(terms, axis=-2) * cot)

  want = jax.grad(dense, argnums=(0, 1, 2))(x, w, a)
  for name, got, ref in zip(("x", "topk_weights", "expert scales"), (gx, gw, ga), want):
    np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-4, atol=1e-4,
                               err_msg=f"gradient w.r.t. {name}")


def test_rail_layout_sends_each_token_to_each_host_once():
  """A token with several experts on one host crosses to it once (the host dispatch fans it
  out there); the rows keep token order."""
  backend, _ = _make(2, 2, num_experts=8, num_topk=3, hidden=8, max_tokens=4,
                     dtype=jnp.float32)
  # Experts 0-3 on host 0 (ranks 0, 1), 4-7 on host 1 (ranks 2, 3).
  idx = jnp.array([[0, 2, 3], [4, 5, -1], [1, 6, 7], [-1, -1, -1]], jnp.int32)
  rail_pos, rail_src, counts = backend._rail_layout(idx)
  np.testing.assert_array_equal(rail_pos, [[0, -1], [-1, 0], [1, 1], [-1, -1]])
  np.testing.assert_array_equal(rail_src, [[0, 2, -1, -1], [1, 2, -1, -1]])
  np.testing.assert_array_equal(counts, [2, 2])


def test_host_group_numbers_each_expert_once_per_source_host():
  """The host group's experts: `(g * L + e) * Hn + h'` for expert e of host rank g and rows
  from host h', so an expert's rows come ordered by (source host, local source, token), and
  the host dispatch of the stacked blocks takes the group's capacity."""
  config = EPConfig("ep", 4, 8, 2, 16, 3, np.dtype(np.float32), 10)
  host = hierarchical.host_config(config, 2)
  assert (host.num_ranks, host.num_experts, host.num_local_experts) == (2, 8, 4)
  assert (host.max_tokens_per_rank, host.capacity) == (6, 10)
  hosts = ((0, 1), (2, 3))
  backend = hierarchical.Hierarchy(config, hosts, ReferenceBackend(host), None,
                                   lambda: jnp.int32(1))
  # Experts 0-3 on host 0, 4-7 on host 1 (rank 2: 4, 5; rank 3: 6, 7); this rank is on host 1.
  recv_idx = jnp.array([[[4, 7], [0, 6], [5, 5]], [[6, 1], [-1, 4], [7, 7]]], jnp.int32)
  got = backend._host_ids(recv_idx, jnp.array([2, 3], jnp.int32))
  np.testing.assert_array_equal(got, [[[0, 6], [-1, 4], [-1, -1]], [[5, -1], [-1, 1], [7, 7]]])


@pytest.mark.parametrize("hosts", [((0, 2), (1, 3)), ((0, 1), (2,)), ()])
def test_hosts_must_be_equal_and_contiguous(hosts):
  """A host's ranks must be contiguous for (host, local index) order to be rank order."""
  assert not hierarchical.contiguous_hosts(hosts)
  config = EPConfig("ep", 4, 8, 2, 16, 3, np.dtype(np.float32), 10)
  with pytest.raises(ValueError, match="contiguous in rank order"):
    hierarchical.Hierarchy(config, hosts, None, None, None)
  assert hierarchical.contiguous_hosts(((0, 1), (2, 3)))


def test_expert_alignment_is_refused_across_hosts():
  """The host group lays out each expert as one host expert per source host, so no single
  prefix sum places expert_alignment's padding: the composition refuses it, and so does a
  group that would run it (virtual_hosts takes the cuda network transport)."""
  config = EPConfig("ep", 4, 8, 2, 128, 16, np.dtype(np.float32), 256, expert_alignment=8)
  hosts = ((0, 1), (2, 3))
  with pytest.raises(ValueError, match="expert_alignment=8 is not implemented across hosts"):
    hierarchical.Hierarchy(config, hosts, ReferenceBackend(hierarchical.host_config(config, 2)),
                           hierarchical.reference_rail_exchange("hosts"), _host_index)
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices")
  mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices()[:4])
  with pytest.raises(ValueError, match="expert_alignment=8 is not implemented on the cuda "
                                       "backend's network transport"):
    jax_ep.Group(mesh, "ep", num_experts=8, num_topk=2, hidden=128, max_tokens_per_rank=16,
                 virtual_hosts=2, expert_alignment=8)
