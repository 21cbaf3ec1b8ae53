"""The decode experts' Pallas kernels (`jax_ep.expert_mlp_slabs`, jax_ep/kernels/slab_mlp.py) the
way the layer calls them: inside `shard_map`, under `grad`, `vmap` and `jax.checkpoint`.

On the CPU the kernels are traced (not run) inside `shard_map`: a Pallas call's result must be
given its varying axes there, which the trace checks as the GPU's does. On a GPU (marked `gpu`)
the compiled kernels run against the dense formulation (`slab_mlp.dense_mlp`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ep_test_base import rank_mesh, require_gpu
from jax_ep.kernels import slab_mlp

L, S, H, F = 4, 128, 256, 128  # per rank: experts, slab rows, hidden, ffn


def _operands(num_ranks, seed=0):
  rng = np.random.default_rng(seed)
  rows = jnp.asarray(rng.standard_normal((num_ranks * L, S, H)), jnp.bfloat16)
  w_gate, w_up = (jnp.asarray(rng.standard_normal((num_ranks * L, H, F)) * H ** -0.5,
                              jnp.bfloat16) for _ in range(2))
  w_down = jnp.asarray(rng.standard_normal((num_ranks * L, F, H)) * F ** -0.5, jnp.bfloat16)
  count = np.asarray(rng.integers(0, S, num_ranks * L), np.int32)
  count[0], count[-1] = 0, S  # an expert with no row, one with a full slab
  return rows, w_gate, w_up, w_down, jnp.asarray(count)


def _body(impl, wrap):
  """Per rank: the output's rows below count (zeros past them) and the gradient of their sum
  w.r.t. the rows and the three weights."""
  def loss(rows, w_gate, w_up, w_down, count):
    out = slab_mlp.slab_mlp(rows, w_gate, w_up, w_down, count, impl=impl)
    used = jnp.arange(S)[None, :, None] < count[:, None, None]
    out = jnp.where(used, out.astype(jnp.float32), 0.0)
    return jnp.sum(out * jnp.cos(jnp.arange(H, dtype=jnp.float32))), out
  if wrap == "checkpoint":
    loss = jax.checkpoint(loss)
  grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)

  def body(rows, w_gate, w_up, w_down, count):
    if wrap == "vmap":  # two micro-batches of slabs, one set of experts
      grads, out = jax.vmap(grad, in_axes=(0, None, None, None, 0))(
          jnp.stack([rows, rows[:, ::-1]]), w_gate, w_up, w_down, jnp.stack([count, count // 2]))
      return grads[0][0], jnp.sum(grads[1], 0), jnp.sum(grads[2], 0), jnp.sum(grads[3], 0), \
          out[1]
    grads, out = grad(rows, w_gate, w_up, w_down, count)
    return (*grads, out)
  return body


def _mapped(mesh, impl, wrap):
  return jax.jit(jax.shard_map(_body(impl, wrap), mesh=mesh, in_specs=P("ep"),
                               out_specs=P("ep")))


def _put(mesh, *arrays):
  return [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in arrays]


@pytest.mark.parametrize("wrap", ["plain", "checkpoint", "vmap"])
def test_kernels_trace_inside_shard_map(wrap):
  mesh = rank_mesh(2)
  args = _put(mesh, *_operands(2))
  out_avals = _mapped(mesh, "pallas", wrap).trace(*args).jaxpr.out_avals
  assert [a.shape for a in out_avals] == [(2 * L, S, H), (2 * L, H, F), (2 * L, H, F),
                                          (2 * L, F, H), (2 * L, S, H)]


@pytest.mark.gpu
@pytest.mark.parametrize("wrap", ["plain", "checkpoint", "vmap"])
def test_compiled_kernels_inside_shard_map_under_grad(wrap):
  require_gpu()
  mesh = rank_mesh(1)
  args = _put(mesh, *_operands(1, seed=5))
  assert slab_mlp.resolve_impl("auto", (L, S, H), F, jnp.bfloat16) == "pallas"
  got = _mapped(mesh, "auto", wrap)(*args)
  want = _mapped(mesh, "dense", wrap)(*args)
  for name, g, w in zip(("d rows", "d w_gate", "d w_up", "d w_down", "out"), got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(g).all(), name
    scale = float(np.abs(w).max()) + 1e-6
    assert float(np.abs(g - w).max()) <= 2e-2 * scale, name
