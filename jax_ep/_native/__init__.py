"""Where Python meets compiled code: the `_jax_ep_ffi` extension and the JAX runtime rules that
XLA custom calls need.

- `ffi`: loads the extension (when it was built) and registers its FFI targets with XLA.
- `limits`: the kernels' limits, one table exported by the extension, and the check a group is
  created with.
- `varying`: the `shard_map` axes a custom call's outputs and a custom_vjp's cotangents vary
  over.
- `effects`: settling JAX's runtime effect tokens after a check inside a computation failed.

May import: jax, numpy and `jax_ep.config` alone; every other layer may import this one.
"""
