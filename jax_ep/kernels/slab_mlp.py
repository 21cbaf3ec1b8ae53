"""The decode experts' kernels: `jax_ep.experts.slab`, with the names their tests read here
(`Tiles`, `TILE_RULE`, `tiles_for`); the tiles are chosen in `jax_ep.experts.configs` and
overridden with `jax_ep.experts.override(slab_tiles=...)`."""
from jax_ep.experts.configs import SLAB_TILE_RULE as TILE_RULE  # noqa: F401
from jax_ep.experts.configs import SlabTiles as Tiles  # noqa: F401
from jax_ep.experts.configs import slab_tiles as tiles_for  # noqa: F401
from jax_ep.experts.slab import dense_mlp, kernel_fits, resolve_impl, slab_mlp  # noqa: F401

# NOTES: nothing reads this name; it is here so that code which still assigns it keeps
# importing. The slab tiles are overridden with `jax_ep.experts.override(slab_tiles=...)`.
TILES_OVERRIDE = None
