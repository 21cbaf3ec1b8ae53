"""The two things MaxText's configs call a factor, in jax_ep: `Group(buffer_factor=f)` sizes a
rank's receive buffer as MaxText's `ragged_buffer_factor` does, and
`jax_ep.limit_expert_capacity` drops the slots past each expert's capacity per sequence as
MaxText's (and GShard's) `capacity_factor` does. Each is held against MaxText's formula written
out here; `capacity_factor` itself is refused with a message that says which is which."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_test_base import rank_mesh
from jax_ep.gmm import ROW_TILE


# ------------------------------------------------------------------ MaxText's formulas

def maxtext_ragged_buffer_rows(tokens_per_rank, num_topk, factor):
  """MaxText's ragged buffer of one rank: its balanced share of the slots, `T * K` (the global
  `batch * seq * K` over the expert-parallel ranks), times `ragged_buffer_factor`."""
  return int(tokens_per_rank * num_topk * factor)


def maxtext_kept_slots(topk_idx, num_experts, capacity_factor):
  """MaxText's `generate_masks` for `[B, S, K]` ids, as it computes it: the per-expert capacity
  `int(max(ceil(S * K / E) * f, f))`, a one-hot over experts, a running count along the
  sequence's `S * K` slots in (token, slot) order, and a slot kept while its count is at most
  the capacity. Returns the `[B, S, K]` bool mask of kept slots."""
  batch, seq, k = topk_idx.shape
  capacity = int(max(math.ceil(seq * k / num_experts) * capacity_factor, capacity_factor))
  expert_mask = np.eye(num_experts, dtype=np.int32)[topk_idx]            # [B, S, K, E]
  fused = expert_mask.reshape(batch, seq * k, num_experts)
  count = np.cumsum(fused, axis=1).reshape(batch, seq, k, num_experts)
  truncated = expert_mask * (count <= capacity)
  return truncated.sum(axis=-1).astype(bool)


# ------------------------------------------------------------------ buffer_factor

@pytest.mark.parametrize("t,k,f", [(4096, 8, 1.25), (1024, 2, 1.0), (512, 4, 1.5),
                                   (640, 1, 0.8), (96, 4, 2.0), (100, 3, 1.1), (33, 8, 1.7)])
def test_buffer_factor_is_maxtexts_ragged_buffer_in_whole_row_tiles(t, k, f):
  """The same rows where MaxText's count is a whole number of the grouped GEMM's row tiles, and
  the next whole tile above it elsewhere (never fewer rows than MaxText's buffer)."""
  r, e = 8, 64
  rows = jax_ep.capacity_from_buffer_factor(f, r, t, k, e // r)
  theirs = maxtext_ragged_buffer_rows(t, k, f)
  worst = jax_ep.default_capacity(r, t, k, e // r)
  if theirs % ROW_TILE == 0 and theirs <= worst:
    assert rows == theirs
  else:
    assert rows == min(-(-math.ceil(t * k * f) // ROW_TILE) * ROW_TILE, worst)
    assert rows >= min(theirs, worst)


@pytest.mark.parametrize("call", ["group", "memory_bytes"])
def test_capacity_factor_is_refused_naming_both_meanings(call):
  kwargs = dict(num_experts=8, num_topk=2, hidden=64, max_tokens_per_rank=16,
                backend="reference", capacity_factor=1.25)
  message = (r"jax_ep takes no capacity_factor \(got 1.25\).*buffer_factor=f sizes each "
             r"rank's receive buffer.*ragged_buffer_factor.*jax_ep.limit_expert_capacity.*"
             r"GShard's capacity_factor")
  with pytest.raises(TypeError, match=message):
    if call == "group":
      jax_ep.Group(rank_mesh(2), "ep", **kwargs)
    else:
      jax_ep.memory_bytes(num_ranks=2, **kwargs)


# ------------------------------------------------------------------ limit_expert_capacity

@pytest.mark.parametrize("f", [0.5, 0.75, 1.0, 1.25, 2.0])
@pytest.mark.parametrize("batch,seq,k,e", [(8, 32, 2, 8), (2, 64, 4, 16), (3, 5, 2, 8),
                                           (1, 16, 8, 8)])
def test_limit_expert_capacity_keeps_what_maxtext_keeps(batch, seq, k, e, f):
  rng = np.random.default_rng(batch * 1000 + seq + k + e)
  # Skewed as routers are (a few experts popular), duplicates within a token included.
  popularity = rng.dirichlet(np.full(e, 0.5))
  ids = rng.choice(e, size=(batch, seq, k), p=popularity).astype(np.int32)
  kept = maxtext_kept_slots(ids, e, f)
  limited, dropped = jax.jit(
      lambda i: jax_ep.limit_expert_capacity(i, e, f, sequence_length=seq))(
          jnp.asarray(ids.reshape(batch * seq, k)))
  limited = np.asarray(limited).reshape(batch, seq, k)
  np.testing.assert_array_equal(limited, np.where(kept, ids, -1))
  assert int(dropped) == int((~kept).sum())
  assert jax_ep.expert_capacity(seq, k, e, f) == int(max(math.ceil(seq * k / e) * f, f))


def test_limit_expert_capacity_leaves_unrouted_and_invalid_ids_uncounted():
  # S = 4, K = 2, E = 2, f = 0.5: capacity int(ceil(8 / 2) * 0.5) = 2 slots per expert.
  ids = jnp.array([[0, -1], [0, 9], [0, 1], [0, 1]], jnp.int32)
  limited, dropped = jax_ep.limit_expert_capacity(ids, 2, 0.5)
  np.testing.assert_array_equal(np.asarray(limited), [[0, -1], [0, 9], [-1, 1], [-1, 1]])
  assert int(dropped) == 2


def test_limited_slots_contribute_nothing_to_combine():
  """Per rank inside `shard_map`: the limited ids through dispatch and combine (reference
  backend, identity experts) give the sum of the kept slots' weighted rows."""
  r, seq, k, e, h = 2, 8, 2, 4, 16
  group = jax_ep.Group(rank_mesh(r), "ep", num_experts=e, num_topk=k, hidden=h,
                       max_tokens_per_rank=2 * seq, dtype=jnp.float32, backend="reference")
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(r * 2 * seq, h)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, e, size=(r * 2 * seq, k)), jnp.int32)
  w = jnp.asarray(rng.uniform(size=(r * 2 * seq, k)), jnp.float32)

  def body(x, ids, w):
    limited, dropped = jax_ep.limit_expert_capacity(ids, e, 0.75, sequence_length=seq)
    recv, handle = jax_ep.dispatch(group, x, limited, w)
    return jax_ep.combine(group, recv.x, handle), limited, dropped[None]

  x, ids, w = (jax.device_put(a, jax.NamedSharding(group.mesh, P("ep"))) for a in (x, ids, w))
  out, limited, dropped = jax.jit(jax.shard_map(
      body, mesh=group.mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))(x, ids, w)
  limited = np.asarray(limited)
  want = np.einsum("tk,th->th", np.where(limited >= 0, np.asarray(w), 0.0), np.asarray(x))
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
  assert int(np.asarray(dropped).sum()) == int((limited < 0).sum()) > 0


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(capacity_factor=0.0), ValueError, "capacity_factor must be a positive finite"),
    (dict(capacity_factor=True), ValueError, "capacity_factor must be a positive finite"),
    (dict(capacity_factor=1.0, sequence_length=3), ValueError,
     r"sequence_length=3 must divide the 8 tokens"),
    (dict(capacity_factor=1.0, sequence_length=0), ValueError, "sequence_length"),
])
def test_limit_expert_capacity_bad_arguments_are_named(kwargs, error, message):
  with pytest.raises(error, match=message):
    jax_ep.limit_expert_capacity(jnp.zeros((8, 2), jnp.int32), 4, **kwargs)
