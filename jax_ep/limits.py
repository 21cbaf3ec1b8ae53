"""Deprecated: moved to `jax_ep._native.limits`."""
from jax_ep._deprecated import alias
alias(__name__, "jax_ep._native.limits")
