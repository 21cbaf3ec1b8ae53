"""The expert kernels' tiles and `jax_ep.experts.override`, the one way to replace a choice
(jax_ep/experts/configs.py): the tables keyed by architecture and dtype, the override's checks
and nesting, and each field reaching the choice it names."""

import itertools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_ep
from jax_ep import experts
from jax_ep.experts import builds, configs, slab
from jax_ep.experts.configs import KernelTiles, SlabTiles


def test_the_tables_are_keyed_by_architecture_and_dtype():
  deepseek = (256, 7168, 2048)
  for dtype in (jnp.bfloat16, jnp.float16):
    assert configs.tile_config(32768, *deepseek, dtype) == configs.TILE_TABLES[
        (configs.HOPPER, np.dtype(dtype))][deepseek]
  # An architecture without a table takes the rule: two compute warpgroups where 256 divides N.
  assert configs.tile_config(32768, *deepseek, jnp.bfloat16, arch="sm100") == KernelTiles(
      128, 128, 64, 3, 1, compute_wgs=2)


def test_override_names_its_fields_and_checks_impl():
  with pytest.raises(TypeError, match=r"unknown field\(s\) \['tiles'\]; the fields are"):
    with experts.override(tiles=None):
      pass
  with pytest.raises(ValueError, match="impl must be 'auto', 'mosaic' or 'xla', got 'fast'"):
    with experts.override(impl="fast"):
      pass


def test_kernel_sms_bounds_the_persistent_grid(monkeypatch):
  import types
  from jax_ep.experts import hopper
  monkeypatch.setattr(hopper, "target_devices", lambda: [types.SimpleNamespace(core_count=132)])
  assert hopper.num_sms() == 132
  with experts.override(kernel_sms=108):
    assert hopper.num_sms() == 108
    with experts.override(kernel_sms=528):  # four waves
      assert hopper.num_sms() == 528
  assert hopper.num_sms() == 132
  # Tiles of two CTAs per SM double the grid over the SMs it is sized for.
  two = KernelTiles(128, 128, 64, 3, 4, ctas_per_sm=2)
  assert hopper.persistent_grid(KernelTiles()) == (132,)
  assert hopper.persistent_grid(two) == (264,)
  with experts.override(kernel_sms=108):
    assert hopper.persistent_grid(two) == (216,)
  for bad in (0, -3, 1.5, True, "all"):
    with pytest.raises(ValueError, match=f"kernel_sms must be a positive int or None, got "
                                         f"{bad!r}"):
      with experts.override(kernel_sms=bad):
        pass


def test_override_blocks_nest_and_restore():
  small = KernelTiles(64, 64, 64, 2, 1)
  assert configs.current() == experts.Overrides()
  with experts.override(impl="xla", gemm_tiles=small):
    with experts.override(weight_grad_specialized=True):
      now = configs.current()
      assert (now.impl, now.gemm_tiles, now.weight_grad_specialized) == ("xla", small, True)
      assert configs.weight_grad_specialized()
    assert configs.current().weight_grad_specialized is None
    assert not configs.weight_grad_specialized()
  assert configs.current() == experts.Overrides()


def test_each_field_reaches_its_choice():
  small = KernelTiles(64, 64, 64, 2, 1)
  with experts.override(gemm_tiles=small, weight_grad_tiles=small, fused_tiles=small):
    assert configs.tile_config(100, 8, 128, 192) == small
    assert configs.tile_config(100, 8, 100, 192) is None  # K % 64
    assert configs.weight_grad_tiles(128, 64, 256) == small
    assert configs.fused_tiles(128, 64) == small
    assert configs.fused_input_grad_tiles(64, 128) == small
  with experts.override(impl="xla"):
    assert jax_ep.grouped_matmul_impl(256, 4, 128, 128, jnp.bfloat16) == ("xla", "asked for")
    x, w = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16)
    jax_ep.grouped_matmul(x, w, jnp.asarray([3, 5], jnp.int32))  # traces on lax.ragged_dot
  tiles = SlabTiles(32, 128, 64, 4, 3)
  with experts.override(slab_tiles=tiles):
    assert configs.slab_tiles(128, 7168, 2048) == tiles  # the rule would take 16-row tiles
    assert slab.kernel_fits((4, 24, 256), 256, jnp.bfloat16) == (
        "rows per slab = 24 is not a multiple of 32")
  assert configs.slab_tiles(128, 7168, 2048) == SlabTiles(16, 128, 64, 4, 3)


def test_the_fused_kernels_default_to_two_compute_warpgroups_where_n_holds_them():
  """The fused gated projections and hidden gradient take the warp-specialized kernels where
  F holds a CTA's 128 columns, one warpgroup of 64 columns where it does not; an override of
  `fused_tiles` reaches every fused kernel."""
  stages = configs.FUSED_SPECIALIZED_STAGES
  assert configs.fused_tiles(7168, 2048) == KernelTiles(
      128, 64, 64, stages["gated"], 4, compute_wgs=2)
  assert configs.fused_hidden_grad_tiles(7168, 2048) == KernelTiles(
      128, 64, 64, stages["hidden_grad"], 4, compute_wgs=2)
  assert configs.fused_input_grad_tiles(2048, 7168) == KernelTiles(128, 128, 64, 4, 4)
  assert configs.fused_tiles(256, 192) == KernelTiles(128, 64, 64, 4, 4)
  assert configs.fused_hidden_grad_tiles(256, 192) == KernelTiles(128, 64, 64, 4, 4)
  assert configs.fused_tiles(100, 256) is None
  small = KernelTiles(64, 64, 64, 2, 1)
  with experts.override(fused_tiles=small):
    assert configs.fused_tiles(256, 256) == configs.fused_hidden_grad_tiles(256, 256) == small


def test_every_size_a_multiple_of_128_takes_a_known_build():
  """The kernel choice compiles a probe of the kernels (doubling a first step's Mosaic GPU
  compile) unless their build is known: every hidden and ffn size that is a multiple of 128,
  at any group count, makes known builds of the grouped GEMM, the fused MLP and the FP8 MLP
  (its FP8 weight gradients: the bf16 ones are an override, probed), every activation (the
  example's 128 x 256 x 8 and the model shapes among them)."""
  sizes = range(128, 2049, 128)
  for hidden, ffn in itertools.product(sizes, sizes):
    for groups in (1, 2, 8, 32, 63, 64, 128, 256):
      for k, n in ((hidden, ffn), (ffn, hidden)):
        for transpose_w in (False, True):
          build = builds.gmm_build(jnp.bfloat16, transpose_w,
                                    configs.tile_config(4096, groups, k, n), jnp.bfloat16)
          assert build in builds.KNOWN_BUILDS, (hidden, ffn, groups, build)
      for activation in ("swiglu", "geglu", "gelu", "silu"):
        build = builds.fused_mlp_build(jnp.bfloat16, activation, hidden, ffn, groups)
        assert build in builds.KNOWN_BUILDS, (hidden, ffn, groups, build)
        build = builds.fp8_mlp_build(activation, hidden, ffn, groups, True)
        assert build in builds.KNOWN_BUILDS, (hidden, ffn, groups, build)


def _slabs(rng, num_local, rows_per_slab, hidden, ffn, counts, dtype=jnp.bfloat16):
  rows = rng.standard_normal((num_local, rows_per_slab, hidden))
  used = np.arange(rows_per_slab)[None, :, None] < np.asarray(counts)[:, None, None]
  rows = np.where(used, rows, 1e4)  # garbage past count, as the dispatch leaves it
  w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.05, dtype)  # noqa: E731
  return (jnp.asarray(rows, dtype), w(num_local, hidden, ffn), w(num_local, hidden, ffn),
          w(num_local, ffn, hidden), jnp.asarray(counts, jnp.int32))


@pytest.mark.parametrize("tiles", [SlabTiles(32, 128, 64, 4, 3), SlabTiles(64, 256, 64, 8, 3)])
def test_slab_kernels_at_overridden_tiles_match_the_dense_formulation(tiles):
  """The slab kernels (in Pallas's interpreter) at the rule's larger tiles, chosen by the
  override: a tile holds several experts' worth of rows only up to its count."""
  counts = [0, 1, 63, 64, 100, 128]
  args = _slabs(np.random.default_rng(5), 6, 128, 256, 512, counts)
  want = slab.dense_mlp(*args)
  with experts.override(slab_tiles=tiles):
    out = jax.jit(lambda *a: jax_ep.expert_mlp_slabs(*a, impl="interpret"))(*args)
  scale = float(np.abs(np.asarray(want, np.float32)).max())
  for l, n in enumerate(counts):
    np.testing.assert_allclose(np.asarray(out[l, :n], np.float32),
                               np.asarray(want[l, :n], np.float32), rtol=2**-6,
                               atol=1e-3 * scale, err_msg=f"expert {l}")
