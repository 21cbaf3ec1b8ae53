"""The plain-XLA baseline of the peer benchmark (bench_intranode.py) computes the contract's results.

`jax.lax.ragged_all_to_all` is not implemented on XLA:CPU, so the pipeline runs here with the
benchmark module's emulation of it (all_to_all on padded blocks); on GPUs the benchmark passes
the real collective.
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ep_test_base import host_value, local_rank_mask, make_routing, rank_mesh
from jax_ep.testing import oracle

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import xla_pipeline  # noqa: E402


def test_emulation_reproduces_the_documented_example():
  """The example of `jax.lax.ragged_all_to_all`'s docstring (JAX 0.11.2), so that the pipeline
  and the emulation cannot share a wrong offset convention unnoticed."""
  mesh = rank_mesh(2, "x")
  args = [np.array(a, np.int32) for a in (
      [[1, 2, 2], [3, 4, 0]], [[0, 0, 0, 0], [0, 0, 0, 0]], [[0, 1], [0, 1]], [[1, 2], [1, 1]],
      [[0, 0], [1, 2]], [[1, 1], [2, 1]])]

  def body(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    return xla_pipeline.emulated_ragged_all_to_all(
        operand[0], output[0], input_offsets[0], send_sizes[0], output_offsets[0],
        recv_sizes[0], axis_name="x", num_ranks=2)[None]

  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("x")))
  result = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
      *map(put, args))
  mine = local_rank_mask(mesh)
  want = np.array([[1, 3, 0, 0], [2, 2, 4, 0]])
  np.testing.assert_array_equal(host_value(result)[mine], want[mine])


def _check_pipeline(num_ranks, pattern, dtype, ragged, tight=False):
  """`tight`: a capacity that just holds the most rows any rank receives (as the benchmark)."""
  num_tokens, hidden, num_topk, num_experts = 6, 16, 3, 8 * num_ranks
  rng = np.random.default_rng(num_ranks)
  x = np.asarray(jnp.asarray(rng.standard_normal((num_ranks, num_tokens, hidden)), dtype))
  idx = make_routing(rng, num_ranks, num_tokens, num_topk, num_experts, pattern)
  w = rng.random((num_ranks, num_tokens, num_topk)).astype(np.float32)
  mesh = rank_mesh(num_ranks)
  expected = oracle.dispatch(x, idx, num_experts, num_ranks * num_tokens * num_topk,
                             merge=False)  # the baseline sends one row per slot
  capacity = max(int(d["group_sizes"].sum()) for d in expected) if tight else None
  kw = dict(axis="ep", num_ranks=num_ranks, num_experts=num_experts, capacity=capacity,
            ragged=ragged)

  def body(x, idx, w):
    grouped, sizes, state = xla_pipeline.dispatch(x[0], idx[0], **kw)
    out = xla_pipeline.combine(grouped, w[0], state, axis="ep", ragged=ragged)
    return grouped[None], sizes[None], out[None]

  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
  grouped, sizes, out = (host_value(v) for v in jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(put(x), put(idx), put(w)))
  mine = local_rank_mask(mesh)
  for d in np.flatnonzero(mine):
    np.testing.assert_array_equal(sizes[d], expected[d]["group_sizes"])
    n = int(expected[d]["group_sizes"].sum())
    np.testing.assert_array_equal(grouped[d][:n], expected[d]["recv_x"][:n])
  # Identity experts: combine returns sum_k w[t, k] * x[t] over the valid slots.
  want = np.einsum("rtk,rth->rth", w * (idx >= 0), x.astype(np.float64))
  tol = 1e-5 if dtype == jnp.float32 else 1.6e-2
  np.testing.assert_allclose(out[mine].astype(np.float64), want[mine], rtol=tol, atol=tol)


@pytest.mark.ranks("num_ranks,pattern,dtype", [
    (2, "uniform", jnp.float32), (4, "hot", jnp.bfloat16), (4, "duplicates", jnp.float32),
    (8, "uniform", jnp.bfloat16)])
def test_pipeline_matches_the_contract(num_ranks, pattern, dtype):
  ragged = functools.partial(xla_pipeline.emulated_ragged_all_to_all, num_ranks=num_ranks)
  _check_pipeline(num_ranks, pattern, dtype, ragged)
  # The benchmark passes a capacity that just holds every received row, and cuts each peer's
  # slice into several updates (3 here: pieces of 0, 1 and more rows all occur).
  _check_pipeline(num_ranks, pattern, dtype, ragged, tight=True)
  _check_pipeline(num_ranks, pattern, dtype, xla_pipeline.split_updates(ragged, 3), tight=True)


def test_split_updates_cuts_each_slice_into_contiguous_pieces():
  seen = {}
  def record(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, **kw):
    seen.update(input_offsets=input_offsets, send_sizes=send_sizes,
                output_offsets=output_offsets, recv_sizes=recv_sizes, kw=kw)
    return output
  split = xla_pipeline.split_updates(record, 3)
  i32 = lambda v: jnp.array(v, jnp.int32)
  split(None, None, i32([0, 7]), i32([7, 2]), i32([10, 0]), i32([1, 5]), axis_name="x")
  got = {k: np.asarray(v).tolist() for k, v in seen.items() if k != "kw"}
  assert got == {"input_offsets": [0, 3, 5, 7, 8, 9], "send_sizes": [3, 2, 2, 1, 1, 0],
                 "output_offsets": [10, 13, 15, 0, 1, 2], "recv_sizes": [1, 0, 0, 2, 2, 1]}
  assert seen["kw"] == {"axis_name": "x"}


@pytest.mark.gpu
@pytest.mark.ranks("num_ranks", [2, 4, 8])
def test_pipeline_with_the_real_collective(num_ranks):
  """On GPUs (one process driving them): the same checks through jax.lax.ragged_all_to_all."""
  devices = jax.devices()
  if devices[0].platform != "gpu" or jax.process_count() > 1 or num_ranks > len(devices):
    pytest.skip(f"needs {num_ranks} GPUs in one process")
  _check_pipeline(num_ranks, "uniform", jnp.bfloat16, jax.lax.ragged_all_to_all)
  _check_pipeline(num_ranks, "hot", jnp.bfloat16,
                  xla_pipeline.split_updates(jax.lax.ragged_all_to_all, 4), tight=True)
