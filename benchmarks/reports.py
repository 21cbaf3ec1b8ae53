"""Benchmark records (JSON Lines with the keys of docs/DESIGN.md section 6), their table, and the
routing the benchmarks draw.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess

import jax
import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")



def git_commit() -> str:
  """The commit measured: $JAX_EP_COMMIT when set (a GPU machine may hold a copy of the tree
  whose git metadata is stale, so the caller passes it), else `git rev-parse`."""
  if os.environ.get("JAX_EP_COMMIT"):
    return os.environ["JAX_EP_COMMIT"]
  try:
    return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"],
                                   cwd=os.path.dirname(__file__), text=True,
                                   stderr=subprocess.DEVNULL).strip()
  except (OSError, subprocess.CalledProcessError):
    return os.environ.get("JAX_EP_COMMIT", "unknown")



def device_name() -> str:
  dev = jax.devices()[0]
  return getattr(dev, "device_kind", dev.platform)



def record(**fields) -> dict:
  base = {"gpu": device_name(), "jax": jax.__version__,
          "date": datetime.date.today().isoformat(), "commit": git_commit()}
  base.update(fields)
  return base



def write_jsonl(records, name: str) -> str:
  os.makedirs(RESULTS_DIR, exist_ok=True)
  path = os.path.join(RESULTS_DIR, name)
  with open(path, "a") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return path



def print_table(records, columns) -> None:
  widths = [max([len(c), *(len(_fmt(r.get(c))) for r in records)]) for c in columns]
  print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
  for r in records:
    print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))



def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
  return str(v)



def uniform_topk(rng, num_tokens: int, num_experts: int, num_topk: int) -> np.ndarray:
  """`[T, K]` int32: K distinct experts per token, uniformly at random."""
  scores = rng.random((num_tokens, num_experts))
  return np.argsort(scores, axis=-1)[:, :num_topk].astype(np.int32)
