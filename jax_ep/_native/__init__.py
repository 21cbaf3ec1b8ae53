"""Where Python meets compiled code: the `_jax_ep_ffi` extension and the JAX runtime rules that
XLA custom calls need.

- `ffi`: loads the extension (when it was built) and registers its FFI targets with XLA.
- `limits`: the kernels' limits, one table exported by the extension, and the check a group is
  created with.
- `varying`: the `shard_map` axes a custom call's outputs and a custom_vjp's cotangents vary
  over.
- `effects`: settling JAX's runtime effect tokens after a check inside a computation failed.
- `fp8`: the fp8 rows the kernels write and read (per-128 e4m3 rounding, UE8M0 packing): one
  rounding for the backends, the FP8 experts and the public `jax_ep.quantize`.

May import: jax, numpy and `jax_ep.config` alone; every other layer may import this one.
"""
