"""Former paths of the expert kernels, which live in the `jax_ep.experts` op package
(`hopper.py`: the grouped GEMM's Mosaic GPU kernels; `slab.py`: the decode experts' kernels)."""
