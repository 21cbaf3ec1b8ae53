"""The experts on the low-latency slabs (jax_ep/experts/slab.py, `jax_ep.expert_mlp_slabs`).

Oracle: the dense formulation (padding rows masked, batched matmuls over whole slabs). The tests
that take `impl` run the kernels in Pallas's interpreter and, on a GPU (marked `gpu`: skipped on
the CPU, a failure under JAX_EP_REQUIRE_GPU=1 where there is no GPU), compiled; the compiled
results are held to the bounds of a compiled kernel (`TOLERANCE`). The layer's way of calling
them, inside `shard_map` under `grad`, `vmap` and `jax.checkpoint`: compiled on a GPU, traced
on the CPU (a Pallas call's result must be given its varying axes there, which the trace checks
as the GPU's does).
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_ep
from ep_test_base import rank_mesh, require_gpu
from jax_ep import experts
from jax_ep.experts import configs, slab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per implementation, `(rtol, atol relative to the output's scale)` against the dense
# formulation. The interpreter adds the hidden dimension in tiles of 64 as the kernels do: an
# element may round one ulp apart. Compiled, the products' own order of fp32 sums too.
TOLERANCE = {"interpret": (2**-6, 1e-3), "pallas": (0.02, 0.02)}


@pytest.fixture(params=["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def impl(request):
  """The kernels in Pallas's interpreter, or compiled (on a GPU)."""
  if request.param == "pallas":
    require_gpu()
  return request.param


def _slabs(rng, num_local, slab, hidden, ffn, counts, dtype=jnp.bfloat16):
  rows = rng.standard_normal((num_local, slab, hidden))
  # Garbage past count, as the dispatch leaves it: it must not reach the rows below count.
  used = np.arange(slab)[None, :, None] < np.asarray(counts)[:, None, None]
  rows = np.where(used, rows, 1e4)
  w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.05, dtype)
  return (jnp.asarray(rows, dtype), w(num_local, hidden, ffn), w(num_local, hidden, ffn),
          w(num_local, ffn, hidden), jnp.asarray(counts, jnp.int32))


def _check_rows(out, want, counts, rtol=0.0, atol=0.0):
  for l, n in enumerate(np.asarray(counts)):
    np.testing.assert_allclose(np.asarray(out[l, :n], np.float32),
                               np.asarray(want[l, :n], np.float32), rtol=rtol, atol=atol,
                               err_msg=f"expert {l}")


def _check_close(out, want, counts, impl):
  rtol, atol = TOLERANCE[impl]
  scale = float(np.abs(np.asarray(want, np.float32)).max())
  _check_rows(out, want, counts, rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_kernels_match_the_dense_formulation(dtype, impl):
  """Empty, partial, one-tile and full slabs; rows past count inside a computed tile are
  zero."""
  counts = [5, 0, 32, 16, 17]
  args = _slabs(np.random.default_rng(0), 5, 32, 128, 256, counts, dtype)
  want = slab.dense_mlp(*args)
  out = jax.jit(lambda *a: jax_ep.expert_mlp_slabs(*a, impl=impl))(*args)
  _check_close(out, want, counts, impl)
  assert not np.any(np.asarray(out[0, 5:16], np.float32)), "rows past count in a tile"


@pytest.mark.parametrize("tiles", [configs.SlabTiles(32, 128, 64, 4, 3),
                                   configs.SlabTiles(64, 256, 64, 8, 3)])
def test_every_tile_setting_of_the_rule_matches(tiles, impl):
  """The larger tiles the rule takes for larger slabs: a tile holds several experts' worth of
  rows only up to its count, columns past one tile of 128."""
  counts = [0, 1, 63, 64, 100, 128]
  args = _slabs(np.random.default_rng(5), 6, 128, 256, 512, counts)
  want = slab.dense_mlp(*args)
  with experts.override(slab_tiles=tiles):
    out = jax.jit(lambda *a: jax_ep.expert_mlp_slabs(*a, impl=impl))(*args)
  _check_close(out, want, counts, impl)


def test_the_tile_rule_follows_the_slab_size():
  assert configs.slab_tiles(128, 7168, 2048) == configs.SlabTiles(16, 128, 64, 4, 3)
  assert configs.slab_tiles(512, 7168, 2048) == configs.SlabTiles(32, 128, 64, 4, 3)
  assert configs.slab_tiles(1024, 7168, 2048) == configs.SlabTiles(64, 256, 64, 8, 3)
  # A large slab whose columns the 256-wide tile does not divide takes the next rule's tiles.
  assert configs.slab_tiles(1024, 7168, 1408) == configs.SlabTiles(32, 128, 64, 4, 3)
  assert configs.slab_tiles(24, 7168, 2048) is None


def test_gradients_are_the_dense_formulations(impl):
  """The backward is the dense formulation's: exactly so in the interpreter (one program on
  the CPU); compiled, to the order of XLA's fp32 sums in two programs (the bound of the
  compiled check inside shard_map below)."""
  counts = [3, 16, 0]
  rows, wg, wu, wd, count = _slabs(np.random.default_rng(1), 3, 16, 128, 128, counts)
  used = jnp.arange(16)[None, :, None] < count[:, None, None]

  def loss(impl):
    def f(r, g, u, d):
      y = jax_ep.expert_mlp_slabs(r, g, u, d, count, impl=impl).astype(jnp.float32)
      return jnp.sum(jnp.where(used, y, 0.0) * 0.1)
    return jax.grad(f, argnums=(0, 1, 2, 3))(rows, wg, wu, wd)
  for got, want in zip(loss(impl), loss("dense")):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if impl == "interpret":
      np.testing.assert_array_equal(got, want)
    else:
      assert float(np.abs(got - want).max()) <= 2e-2 * (float(np.abs(want).max()) + 1e-6)


def test_vmap_over_a_leading_axis(impl):
  counts = [[4, 16], [0, 9]]
  batch = [_slabs(np.random.default_rng(2 + b), 2, 16, 128, 128, counts[b]) for b in range(2)]
  stacked = [jnp.stack(parts) for parts in zip(*batch)]
  out = jax.vmap(lambda *a: jax_ep.expert_mlp_slabs(*a, impl=impl))(*stacked)
  for b in range(2):
    _check_close(out[b], slab.dense_mlp(*batch[b]), counts[b], impl)


def test_implementation_choice_and_its_errors():
  shape = (4, 32, 256)
  assert slab.resolve_impl("dense", shape, 256, jnp.bfloat16) == "dense"
  if jax.default_backend() != "gpu":
    assert slab.resolve_impl("auto", shape, 256, jnp.bfloat16) == "dense"
  assert slab.kernel_fits(shape, 256, jnp.float32).startswith("dtype float32")
  assert slab.kernel_fits((4, 24, 256), 256, jnp.bfloat16) == (
      "rows per slab = 24 is not a multiple of 16")
  assert slab.kernel_fits(shape, 96, jnp.bfloat16) == "ffn = 96 is not a multiple of 64"
  with pytest.raises(ValueError, match="impl must be 'auto', 'pallas', 'interpret' or 'dense'"):
    slab.resolve_impl("fast", shape, 256, jnp.bfloat16)
  with pytest.raises(ValueError, match="impl='pallas' cannot take these slabs: dtype float32"):
    slab.resolve_impl("pallas", shape, 256, jnp.float32)


def test_bench_slab_mlp_writes_records(tmp_path):
  out = tmp_path / "slab.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_slab_mlp.py"), "--shapes",
       "qwen3_30b_a3b", "--scale", "16", "--ranks", "1", "2", "--tokens", "16", "--impls",
       "interpret", "dense", "--repeats", "2", "--out", str(out)],
      env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert {(r["impl"], r["ranks"]) for r in records} == {
      (i, r) for i in ("interpret", "dense") for r in (1, 2)}
  for r in records:
    assert r["mode"] == "low_latency" and r["op"] == "expert_mlp_slabs" and r["median_us"] > 0
    assert r["slab_rows"] == r["experts_per_rank"] * r["slab"] and 0 < r["rows"] <= r["slab_rows"]


@pytest.mark.gpu
def test_compiled_kernels_on_the_gpu():
  """The kernels compiled (Triton) against the dense formulation at a decode-like shape, and
  `auto` takes them there."""
  require_gpu()
  rng = np.random.default_rng(3)
  for rows in (128, 512, 1024):  # slab rows: each of the tile rule's settings
    counts = rng.integers(0, 3 * rows // 8, size=8)
    counts[0], counts[1] = 0, rows
    args = _slabs(rng, 8, rows, 512, 256, counts)
    assert slab.resolve_impl("auto", args[0].shape, 256, jnp.bfloat16) == "pallas"
    want = slab.dense_mlp(*args)
    out = jax.jit(lambda *a: jax_ep.expert_mlp_slabs(*a))(*args)
    scale = float(np.abs(np.asarray(want, np.float32)).max())
    _check_rows(out, want, counts, rtol=0.02, atol=0.02 * scale)


# ---------------------------------------------------------------------- inside shard_map
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
    out = slab.slab_mlp(rows, w_gate, w_up, w_down, count, impl=impl)
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


# GPU only: Pallas's interpreter refuses to run inside shard_map (its dynamic slices mix
# varying and unvarying operands); on the CPU the trace above is what can be checked.
@pytest.mark.gpu
@pytest.mark.parametrize("wrap", ["plain", "checkpoint", "vmap"])
def test_compiled_kernels_inside_shard_map_under_grad(wrap):
  require_gpu()
  mesh = rank_mesh(1)
  args = _put(mesh, *_operands(1, seed=5))
  assert slab.resolve_impl("auto", (L, S, H), F, jnp.bfloat16) == "pallas"
  got = _mapped(mesh, "auto", wrap)(*args)
  want = _mapped(mesh, "dense", wrap)(*args)
  for name, g, w in zip(("d rows", "d w_gate", "d w_up", "d w_down", "out"), got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(g).all(), name
    scale = float(np.abs(w).max()) + 1e-6
    assert float(np.abs(g - w).max()) <= 2e-2 * scale, name
