"""Test helpers for jax_ep: obviously-correct models to compare the expert-parallel code against.

- `jax_ep.testing.oracle`: numpy loops over all ranks' inputs for dispatch/combine semantics.
- `jax_ep.testing.dense`: a dense, differentiable `jnp` MoE layer (no communication) matching
  `jax_ep.moe_mlp`, for checking forward values and gradients.
- `jax_ep.testing.aot`: compile-only H200 devices, for compiling programs (XLA's GPU passes,
  the Mosaic GPU kernels through ptxas) on a machine without a GPU.

May import: the public API (the layer's parameters, the routers) and numpy; the library never
imports this package (tests, benchmarks and the demo do).
"""
