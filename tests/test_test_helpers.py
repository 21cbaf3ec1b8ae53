"""The test base's own helpers: the elementwise closeness check, the bf16-wire error bound and
the groups a `Target` makes."""

import types

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ep_test_base import assert_close, make_routing, partial_rounding_bound
from jax_ep.testing import oracle


def test_assert_close_takes_an_elementwise_atol_and_names_the_worst_element():
  want = np.array([1.0, 2.0, 3.0])
  assert_close(want + [0.05, 0.0, 0.5], want, rtol=0.0, atol=np.array([0.1, 0.0, 0.5]))
  with pytest.raises(AssertionError, match=r"1 of 3 elements .* worst at \(2,\): got 3.6"):
    assert_close(want + [0.05, 0.0, 0.6], want, rtol=0.0, atol=np.array([0.1, 0.0, 0.5]))
  with pytest.raises(AssertionError, match="1 of 3"):
    assert_close([1.0, np.nan, 3.0], want, rtol=1.0, atol=1.0)


def test_bf16_partials_stay_within_the_rounding_bound():
  """Rounds each per-(token, rank) partial to bf16 as the peer transport does, sums in rank
  order in fp32 and checks the result against the exact sum with the bound the tests allow
  (and that the bound is not vacuous: it is far below the partials' size)."""
  rng = np.random.default_rng(0)
  num_ranks, num_tokens, hidden, num_topk, num_experts = 4, 16, 64, 8, 32
  x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
  idx = make_routing(rng, num_ranks, num_tokens, num_topk, num_experts, "uniform")
  w = rng.random((num_ranks, num_tokens, num_topk)).astype(np.float32)
  capacity = num_tokens * num_topk * num_ranks
  expected = oracle.dispatch(x, idx, num_experts, capacity)
  eo = [rng.standard_normal((capacity, hidden)).astype(np.float32) for _ in range(num_ranks)]
  exact = oracle.combine(eo, expected, w, np.float64)

  partials = np.zeros((num_ranks, num_ranks, num_tokens, hidden), np.float32)  # [dst, src, t]
  for d, info in enumerate(expected):
    for row, (s, t, ks) in enumerate(info["rows"]):
      weight = np.float32(sum(w[s, t, k] for k in ks))
      partials[d, s, t] = np.float32(partials[d, s, t] + weight * eo[d][row])
  wire = partials.astype(ml_dtypes.bfloat16).astype(np.float32)
  home = np.zeros((num_ranks, num_tokens, hidden), np.float32)
  for d in range(num_ranks):
    home += wire[d]

  group = types.SimpleNamespace(combine_partial_dtype=np.dtype(jnp.bfloat16))
  bound = partial_rounding_bound(group, eo, expected, w)
  assert_close(home, exact, rtol=0.0, atol=bound + 1e-5)
  assert np.abs(home - exact).max() > 1e-3  # the wire really rounds
  assert bound.max() < 0.05 * np.abs(partials).max() * num_ranks

  fp32 = types.SimpleNamespace(combine_partial_dtype=np.dtype(np.float32))
  assert partial_rounding_bound(fp32, eo, expected, w) == 0.0


def test_a_target_group_takes_the_targets_arguments_and_checks_its_refusals():
  """`make_target_group`: the target's group options under the test's, a skip at a rank count
  the target does not run, its `require` before the group, and an option the target refuses:
  the error it must raise checked (the test fails where the group takes the option), then a
  skip."""
  import dataclasses
  from ep_test_base import REFERENCE, make_target_group
  shape = dict(num_experts=8, num_topk=2, hidden=64, max_tokens=4)
  group = make_target_group(dataclasses.replace(REFERENCE, group_options={"capacity": 40}), 2,
                            **shape, expert_alignment=4)
  assert (group.capacity, group.expert_alignment, group.backend_name) == (40, 4, "reference")
  group.close()
  with pytest.raises(pytest.skip.Exception, match="does not run at R=4"):
    make_target_group(dataclasses.replace(REFERENCE, rank_counts=(2,)), 4, **shape)
  calls = []
  make_target_group(dataclasses.replace(REFERENCE, require=lambda: calls.append(1)), 2, **shape)
  assert calls == [1]
  refuses = dataclasses.replace(REFERENCE, expert_alignment_refused="must be an int in")
  with pytest.raises(pytest.skip.Exception, match="expert_alignment=131072 is refused"):
    make_target_group(refuses, 2, **shape, expert_alignment=1 << 17)  # past the largest one
  with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
    make_target_group(refuses, 2, **shape, expert_alignment=4)  # taken: the target is wrong
