"""The experts on the low-latency slabs (jax_ep/kernels/slab_mlp.py, `jax_ep.expert_mlp_slabs`).

Oracle: the dense formulation (padding rows masked, batched matmuls over whole slabs). On the
CPU the kernels run in Pallas's interpreter; on a GPU (marked `gpu`) compiled, where `auto`
takes them.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from ep_test_base import require_gpu
from jax_ep.kernels import slab_mlp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_kernels_match_the_dense_formulation(dtype):
  """Empty, partial, one-tile and full slabs; rows past count inside a computed tile are
  zero."""
  counts = [5, 0, 32, 16, 17]
  args = _slabs(np.random.default_rng(0), 5, 32, 128, 256, counts, dtype)
  want = slab_mlp.dense_mlp(*args)
  out = jax.jit(lambda *a: jax_ep.expert_mlp_slabs(*a, impl="interpret"))(*args)
  # The kernels add the hidden dimension in tiles of 64: an element may round one ulp apart.
  scale = float(np.abs(np.asarray(want, np.float32)).max())
  _check_rows(out, want, counts, rtol=2**-6, atol=1e-3 * scale)
  assert not np.any(np.asarray(out[0, 5:16], np.float32)), "rows past count in a tile"


@pytest.mark.parametrize("tiles", [slab_mlp.Tiles(32, 128, 64, 4, 3),
                                   slab_mlp.Tiles(64, 256, 64, 8, 3)])
def test_every_tile_setting_of_the_rule_matches(tiles, monkeypatch):
  """The larger tiles the rule takes for larger slabs, in the interpreter: a tile holds several
  experts' worth of rows only up to its count, columns past one tile of 128."""
  monkeypatch.setattr(slab_mlp, "TILES_OVERRIDE", tiles)
  counts = [0, 1, 63, 64, 100, 128]
  args = _slabs(np.random.default_rng(5), 6, 128, 256, 512, counts)
  want = slab_mlp.dense_mlp(*args)
  out = jax.jit(lambda *a: jax_ep.expert_mlp_slabs(*a, impl="interpret"))(*args)
  scale = float(np.abs(np.asarray(want, np.float32)).max())
  _check_rows(out, want, counts, rtol=2**-6, atol=1e-3 * scale)


def test_the_tile_rule_follows_the_slab_size():
  assert slab_mlp.tiles_for(128, 7168, 2048) == slab_mlp.Tiles(16, 128, 64, 4, 3)
  assert slab_mlp.tiles_for(512, 7168, 2048) == slab_mlp.Tiles(32, 128, 64, 4, 3)
  assert slab_mlp.tiles_for(1024, 7168, 2048) == slab_mlp.Tiles(64, 256, 64, 8, 3)
  # A large slab whose columns the 256-wide tile does not divide takes the next rule's tiles.
  assert slab_mlp.tiles_for(1024, 7168, 1408) == slab_mlp.Tiles(32, 128, 64, 4, 3)
  assert slab_mlp.tiles_for(24, 7168, 2048) is None


def test_gradients_are_the_dense_formulations():
  counts = [3, 16, 0]
  rows, wg, wu, wd, count = _slabs(np.random.default_rng(1), 3, 16, 128, 128, counts)
  used = jnp.arange(16)[None, :, None] < count[:, None, None]

  def loss(impl):
    def f(r, g, u, d):
      y = jax_ep.expert_mlp_slabs(r, g, u, d, count, impl=impl).astype(jnp.float32)
      return jnp.sum(jnp.where(used, y, 0.0) * 0.1)
    return jax.grad(f, argnums=(0, 1, 2, 3))(rows, wg, wu, wd)
  for got, want in zip(loss("interpret"), loss("dense")):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_vmap_over_a_leading_axis():
  counts = [[4, 16], [0, 9]]
  batch = [_slabs(np.random.default_rng(2 + b), 2, 16, 128, 128, counts[b]) for b in range(2)]
  stacked = [jnp.stack(parts) for parts in zip(*batch)]
  out = jax.vmap(lambda *a: jax_ep.expert_mlp_slabs(*a, impl="interpret"))(*stacked)
  for b in range(2):
    want = slab_mlp.dense_mlp(*batch[b])
    scale = float(np.abs(np.asarray(want, np.float32)).max())
    _check_rows(out[b], want, counts[b], rtol=2**-6, atol=1e-3 * scale)


def test_implementation_choice_and_its_errors():
  shape = (4, 32, 256)
  assert slab_mlp.resolve_impl("dense", shape, 256, jnp.bfloat16) == "dense"
  if jax.default_backend() != "gpu":
    assert slab_mlp.resolve_impl("auto", shape, 256, jnp.bfloat16) == "dense"
  assert slab_mlp.kernel_fits(shape, 256, jnp.float32).startswith("dtype float32")
  assert slab_mlp.kernel_fits((4, 24, 256), 256, jnp.bfloat16) == (
      "rows per slab = 24 is not a multiple of 16")
  assert slab_mlp.kernel_fits(shape, 96, jnp.bfloat16) == "ffn = 96 is not a multiple of 64"
  with pytest.raises(ValueError, match="impl must be 'auto', 'pallas', 'interpret' or 'dense'"):
    slab_mlp.resolve_impl("fast", shape, 256, jnp.bfloat16)
  with pytest.raises(ValueError, match="impl='pallas' cannot take these slabs: dtype float32"):
    slab_mlp.resolve_impl("pallas", shape, 256, jnp.float32)


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
  for slab in (128, 512, 1024):  # each of the tile rule's settings
    counts = rng.integers(0, 3 * slab // 8, size=8)
    counts[0], counts[1] = 0, slab
    args = _slabs(rng, 8, slab, 512, 256, counts)
    assert slab_mlp.resolve_impl("auto", args[0].shape, 256, jnp.bfloat16) == "pallas"
    want = slab_mlp.dense_mlp(*args)
    out = jax.jit(lambda *a: jax_ep.expert_mlp_slabs(*a))(*args)
    scale = float(np.abs(np.asarray(want, np.float32)).max())
    _check_rows(out, want, counts, rtol=0.02, atol=0.02 * scale)
