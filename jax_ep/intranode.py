"""Deprecated: moved to `jax_ep.backends.transport`."""
from jax_ep._deprecated import alias
alias(__name__, "jax_ep.backends.transport")
