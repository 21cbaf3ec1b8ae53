"""The plain-XLA baseline of the intranode benchmark computes the contract's results.

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

from ep_test_base import make_routing
from jax_ep.testing import oracle

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import xla_pipeline  # noqa: E402


@pytest.mark.parametrize("num_ranks,pattern", [(2, "uniform"), (4, "hot"), (4, "duplicates")])
def test_pipeline_matches_the_contract(num_ranks, pattern):
  if num_ranks > len(jax.devices()):
    pytest.skip(f"needs {num_ranks} devices")
  num_tokens, hidden, num_topk, num_experts = 6, 16, 3, 8
  rng = np.random.default_rng(num_ranks)
  x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
  idx = make_routing(rng, num_ranks, num_tokens, num_topk, num_experts, pattern)
  w = rng.random((num_ranks, num_tokens, num_topk)).astype(np.float32)
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])
  ragged = functools.partial(xla_pipeline.emulated_ragged_all_to_all, num_ranks=num_ranks)
  kw = dict(axis="ep", num_ranks=num_ranks, num_experts=num_experts, ragged=ragged)

  def body(x, idx, w):
    grouped, sizes, state = xla_pipeline.dispatch(x[0], idx[0], **kw)
    out = xla_pipeline.combine(grouped, w[0], state, axis="ep", ragged=ragged)
    return grouped[None], sizes[None], out[None]

  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
  grouped, sizes, out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"),
                                              out_specs=P("ep")))(put(x), put(idx), put(w))
  capacity = num_ranks * num_tokens * num_topk
  expected = oracle.dispatch(x, idx, num_experts, capacity)
  for d in range(num_ranks):
    np.testing.assert_array_equal(np.asarray(sizes)[d], expected[d]["group_sizes"])
    n = int(expected[d]["group_sizes"].sum())
    np.testing.assert_array_equal(np.asarray(grouped)[d][:n], expected[d]["recv_x"][:n])
  # Identity experts: combine returns sum_k w[t, k] * x[t] over the valid slots.
  want = np.einsum("rtk,rth->rth", w * (idx >= 0), x)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
