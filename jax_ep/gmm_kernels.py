"""Deprecated: moved to `jax_ep.kernels.gmm_kernels`."""
from jax_ep._deprecated import alias
alias(__name__, "jax_ep.kernels.gmm_kernels")
