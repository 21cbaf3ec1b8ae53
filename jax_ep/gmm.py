"""`jax_ep.gmm`: the grouped GEMM's public names. The op lives in the `jax_ep.experts` package
(api, choice of kernel, tiles, layout, kernels)."""

from jax_ep.experts.api import grouped_matmul
from jax_ep.experts.checks import check_groups, check_traced_groups
from jax_ep.experts.choice import grouped_matmul_impl
from jax_ep.experts.choice import on_hopper as _on_hopper  # noqa: F401 - the tests' GPU check
from jax_ep.experts.configs import ROW_TILE, KernelTiles, override

__all__ = ["grouped_matmul", "grouped_matmul_impl", "check_groups", "check_traced_groups",
           "ROW_TILE", "KernelTiles", "override"]
