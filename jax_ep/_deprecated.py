"""Old import paths of modules that moved, kept for one release.

Each old path is a module of two lines that calls `alias`, which puts the new module in its place
in `sys.modules`: code that imports the old path gets the very module the new path names (so a
test that patches an attribute through either path patches the one module), with a
`DeprecationWarning` that names the new path. CHANGELOG.md lists them under "Deprecated".
"""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
  """Makes the module `old` (the caller, being imported) the module `new`, with a warning."""
  module = importlib.import_module(new)
  # stacklevel 3: past this function and the alias module to the import that named the old path
  # (the import system's own frames are skipped).
  warnings.warn(f"{old} is deprecated and will be removed in the next release; import {new} "
                f"instead", DeprecationWarning, stacklevel=3)
  sys.modules[old] = module
