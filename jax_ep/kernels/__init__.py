"""jax_ep's Pallas kernels and the dense formulations they are checked against.

- `gmm_kernels`: the grouped GEMM's Mosaic GPU kernels for Hopper (the forward product and the
  weight gradient over rows grouped by expert, driven by a work list built on the device);
  `jax_ep.grouped_matmul` (jax_ep/gmm.py) chooses them and gives them their gradient.
- `slab_mlp`: the experts on the low-latency slabs, stopping at each expert's count;
  `jax_ep.expert_mlp_slabs` calls it.

May import: jax, numpy and `jax_ep._native` alone (no group, no backend: a kernel sees arrays).
"""
