"""Bad input never gives wrong numbers: each public function refuses what it cannot take with a
`ValueError` / `TypeError` that names the argument as the caller wrote it, or counts what only
the device can see in a statistic the docs name.

The checks that reach a group's backend run on the reference backend here and on the cuda
backend at one rank in `TestInputChecksCuda` (marked `gpu`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep

MEMORY = dict(num_ranks=8, num_experts=16, num_topk=2, hidden=64, max_tokens_per_rank=8)


# ------------------------------------------------------------------ memory_bytes, Group's rule

@pytest.mark.parametrize("kwargs,error,message", [
    (dict(num_experts=12), ValueError, r"num_experts=12 must be divisible by num_ranks=8"),
    (dict(hidden=-64), ValueError, r"hidden must be positive, got -64"),
    (dict(backend="cdua"), ValueError, r"backend must be 'reference' or 'cuda' .*got 'cdua'"),
    (dict(num_topk=40), ValueError, r"num_topk=40 must be <= num_experts=16"),
    (dict(num_ranks=0), ValueError, r"num_ranks must be positive, got 0"),
    (dict(num_ranks=2.0), TypeError, r"num_ranks must be an int, got 2.0"),
    (dict(max_tokens_per_rank=True), TypeError, r"max_tokens_per_rank must be an int, got True"),
    (dict(dtype=jnp.int8), TypeError, r"dtype must be one of bfloat16, float16, float32"),
])
def test_memory_bytes_takes_what_a_group_takes(kwargs, error, message):
  with pytest.raises(error, match="jax_ep.memory_bytes: " + message):
    jax_ep.memory_bytes(**dict(MEMORY, **kwargs))


@pytest.mark.parametrize("kwargs", [
    dict(num_experts=0), dict(hidden=-64), dict(num_topk=40), dict(max_tokens_per_rank=2.5),
    dict(dtype=jnp.int8), dict(expert_alignment=0), dict(capacity=0),
    dict(capacity=64, capacity_factor=1.0)])
def test_memory_bytes_refuses_what_a_group_refuses_in_the_same_words(kwargs):
  mesh = jax.make_mesh((8,), ("ep",), devices=jax.devices()[:8])
  config = dict(MEMORY, **kwargs)
  config.pop("num_ranks")
  with pytest.raises((ValueError, TypeError)) as by_group:
    jax_ep.Group(mesh, "ep", backend="reference", **config)
  with pytest.raises(by_group.type) as by_memory:
    jax_ep.memory_bytes(**dict(MEMORY, **kwargs))
  assert (str(by_memory.value).removeprefix("jax_ep.memory_bytes: ")
          == str(by_group.value).removeprefix("jax_ep.Group: "))
