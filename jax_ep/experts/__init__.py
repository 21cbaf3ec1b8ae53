"""The experts' GEMMs as one op package, laid out as the layers of an op:

- `api.py`: `grouped_matmul`, the public op (argument checks, then the differentiable op).
- `choice.py`: which implementation a shape takes and why (`grouped_matmul_impl`), with the
  compile probe that sends a shape whose kernel does not build to `lax.ragged_dot`.
- `grouped.py`: the differentiable grouped GEMM (`jax.custom_vjp`, `jax.vmap` rules).
- `mlp.py`: the expert MLP over expert-grouped rows (`jax_ep.expert_mlp`'s body): on Hopper
  the gated projections as one kernel with the activation in its epilogue.
- `fp8.py`: FP8 weights (`quantize_weights`, 128 x 128 blocks) and the FP8 grouped GEMM's op
  (`grouped_matmul_fp8`: checks, choice, the dequantised fallback).
- `mlp_fp8.py`: the expert MLP in FP8, DeepSeek-V3's recipe (`jax_ep.expert_mlp(..., fp8=True)`).
- `configs.py`: the kernels' tiles keyed by architecture and dtype, and `override`, the one
  way to replace a choice within a block.
- `layout.py`: where the groups' rows are (offsets, bounds, row masks, the work list, vmap's
  folds), computed in this one place.
- `checks.py`: the rules a layout of groups follows, checked at trace time or on the device.
- `hopper.py`: the grouped GEMM for Hopper (Mosaic GPU, wgmma), and what the Hopper kernels
  share (the persistent grid, `launch`).
- `hopper_wgrad.py`: the grouped weight gradient for Hopper.
- `hopper_fp8.py`: the FP8 kernels for Hopper (block-scaled e4m3 wgmma, fp32 promotion every
  128): the product, the gated projections with `h` quantised in the epilogue, the input
  gradient of both projections.
- `slab.py`: the decode experts' Triton kernels on the low-latency slabs.

- `compile_ahead.py`: the Hopper kernels lowered and built once a process, each compiled alone
  on a pool thread while the program that calls it is traced.

A kernel module imports jax, numpy, `jax_ep._native` and `configs` / `layout` /
`compile_ahead` alone (a kernel sees arrays); nothing here imports a group or a backend.
"""

from jax_ep.experts.api import grouped_matmul
from jax_ep.experts.checks import check_groups, check_traced_groups
from jax_ep.experts.choice import grouped_matmul_impl
from jax_ep.experts.configs import ROW_TILE, KernelTiles, Overrides, SlabTiles, override

__all__ = ["grouped_matmul", "grouped_matmul_impl", "check_groups", "check_traced_groups",
           "ROW_TILE", "KernelTiles", "SlabTiles", "Overrides", "override"]
