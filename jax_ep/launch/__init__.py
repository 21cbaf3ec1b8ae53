"""The processes of a `jax.distributed` job on one host: starting them, joining one, agreeing
across them.

- `launcher`: `python -m jax_ep.launch -n N -- CMD...` (the `jax-ep-launch` command) starts N
  copies of a command wired together and supervises them (its docstring has the options).
- `env`: the child side, `initialize_from_env()`: joining the job the launcher's environment
  variables describe.
- `_distributed`: checks across a job's processes through `jax.distributed`'s key-value store
  (the keys groups meet under, the comparison of their configurations, gathered values); the
  library's group creation uses it.

May import: the standard library and jax alone, nothing else of jax_ep: the launcher runs before
any JAX computation, and every layer of jax_ep may import this one.
"""

from jax_ep.launch.env import (CHILD_ENV_VARS, ENV_COORDINATOR, ENV_LOCAL_DEVICE_IDS,
                               ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_SHARED_GPU,
                               initialize_from_env)
from jax_ep.launch.launcher import (EXIT_CANNOT_START, EXIT_INTERRUPTED, EXIT_TIMEOUT,
                                    EXIT_USAGE, child_env, launch, main)

__all__ = [
    "CHILD_ENV_VARS", "ENV_COORDINATOR", "ENV_LOCAL_DEVICE_IDS", "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID", "ENV_SHARED_GPU", "EXIT_CANNOT_START", "EXIT_INTERRUPTED", "EXIT_TIMEOUT",
    "EXIT_USAGE", "child_env", "initialize_from_env", "launch", "main",
]
