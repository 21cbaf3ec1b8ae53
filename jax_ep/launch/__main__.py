"""`python -m jax_ep.launch`: see jax_ep/launch/launcher.py."""

import sys

from jax_ep.launch.launcher import main

sys.exit(main())
