"""The backends: the per-shard operations of dispatch and combine, one implementation each.

- `base`: the `Backend` protocol every backend implements; `primitives`: the custom_vjp rules
  written once on it; `registry`: which backends exist, which one a group gets and why.
- `reference`: the contract in plain JAX, for every platform (the oracle-checked baseline).
- the cuda backend: `cuda` (one class per transport), `cuda_ops` (the `ffi_call` wrappers of the
  kernels), `transport` (the group's native groups and buffers: the peer transport and
  the network transport), `nvshmem` (loading and joining NVSHMEM), `topology` (which
  ranks share a host), `hierarchical` (the high-throughput ops across hosts, composed from a
  host backend and a rail exchange).

May import: `jax_ep._native`, `jax_ep.config`, and each other; never the public API above them
(group, ops, layer), which imports this package.
"""

from jax_ep.backends.base import Backend, HighThroughputBackend
from jax_ep.backends.cuda import LocalBackend, PeerBackend, NetworkBackend
from jax_ep.backends.reference import ReferenceBackend

__all__ = ["Backend", "LocalBackend", "HighThroughputBackend", "PeerBackend",
           "NetworkBackend", "ReferenceBackend"]
