"""Module paths that moved keep importing for one release (CHANGELOG.md, "Deprecated"): each old
path warns with a DeprecationWarning naming its new path and gives the new module itself."""

import importlib
import re
import subprocess
import sys

import pytest

MOVED = {
    "jax_ep.limits": "jax_ep._native.limits",
    "jax_ep.cuda_ops": "jax_ep.backends.cuda_ops",
    "jax_ep.intranode": "jax_ep.backends.transport",
    "jax_ep.hierarchical": "jax_ep.backends.hierarchical",
    "jax_ep.nvshmem": "jax_ep.backends.nvshmem",
    "jax_ep.topology": "jax_ep.backends.topology",
    "jax_ep.primitives": "jax_ep.backends.primitives",
    "jax_ep.gmm_kernels": "jax_ep.kernels.gmm_kernels",
    "jax_ep.slab_mlp": "jax_ep.kernels.slab_mlp",
}


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_old_path_warns_and_gives_the_new_module(old, new, monkeypatch):
  module = importlib.import_module(new)
  monkeypatch.delitem(sys.modules, old, raising=False)  # imported afresh, so that it warns
  pattern = f"{re.escape(old)} is deprecated .*; import {re.escape(new)} instead"
  with pytest.warns(DeprecationWarning, match=pattern):
    alias = importlib.import_module(old)
  assert alias is module


def test_importing_jax_ep_uses_no_old_path():
  code = ("import warnings; warnings.filterwarnings('error', message='jax_ep', "
          "category=DeprecationWarning); import jax_ep, jax_ep.launch, jax_ep.testing.dense")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr
