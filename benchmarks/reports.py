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


def process_model(num_ranks: int) -> str:
  """The records' `process_model`: how this job's processes hold its `num_ranks` devices."""
  from bounds import narrowed_to_one_gpu
  if os.environ.get("JAX_EP_SHARED_GPU") == "1":
    return "shared_gpu"
  if jax.process_count() > 1:
    # "_isolated": each process sees only its own GPU (launch --isolate-gpus); the peer
    # transport then asks NVML, not CUDA, whether the GPUs have P2P atomics.
    return "process_per_gpu_isolated" if narrowed_to_one_gpu() else "process_per_gpu"
  return "single_process_multi_gpu" if num_ranks > 1 else "single_device"


def _kv_client():
  """The `jax.distributed` key-value store client (multi-process runs only)."""
  from jax._src import distributed
  return distributed.global_state.client


def gather_max(key: str, value: float, timeout_s: float = 120) -> float:
  """The largest `value` over all processes (through the distributed key-value store): a
  multi-process op is done when its slowest process is. `key` must be unique per call."""
  if jax.process_count() == 1:
    return value
  client = _kv_client()
  client.key_value_set_bytes(f"bench/{key}/{jax.process_index()}", json.dumps(value).encode())
  return max(json.loads(client.blocking_key_value_get_bytes(f"bench/{key}/{p}",
                                                              int(timeout_s * 1000)))
             for p in range(jax.process_count()))


def barrier(key: str, timeout_s: float = 120) -> None:
  """Returns in every process once all have reached it (through the key-value store)."""
  if jax.process_count() == 1:
    return
  _kv_client().wait_at_barrier(f"bench/{key}", int(timeout_s * 1000))
