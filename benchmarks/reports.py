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


class Records(list):
  """A benchmark's records, each appended to `benchmarks/results/<name>` as it is added (by
  process 0): a run cut short (its time limit, a later variant out of memory) keeps what it
  measured."""

  def __init__(self, name: str):
    super().__init__()
    self.path = os.path.join(RESULTS_DIR, name)
    self._name = name

  def append(self, record: dict) -> None:
    super().append(record)
    if jax.process_index() == 0:
      write_jsonl([record], self._name)



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


def high_throughput_paths(dest_ranks: np.ndarray, topology) -> tuple[float, float]:
  """Per rank (mean over ranks): the rows that reach it in a high-throughput dispatch by the
  network path and by the peer path, for `dest_ranks` `[R, T, K]` (each slot's destination
  rank) on `topology` (jax_ep.backends.topology.Topology; None: one host).

  A token crosses to each other host that owns one of its experts once, to the rank there with
  the source's local index (the rail receiver: a network row for that rank), which forwards it
  to each rank of its host that needs it (a peer row for each of them except itself). A token
  from the rank's own host arrives by the peer path unless it is the rank's own. Combine moves
  the same rows back on the same paths."""
  r = dest_ranks.shape[0]
  network = np.zeros(r)
  peer = np.zeros(r)
  for src in range(r):
    src_host = topology.host_of(src) if topology is not None else 0
    local = topology.local_index(src) if topology is not None else src
    for token in dest_ranks[src]:
      dests = {int(d) for d in token if d >= 0}
      hosts = {topology.host_of(d) if topology is not None else 0 for d in dests}
      for h in hosts:
        # The rank of host h that holds this token first: the source itself, or its rail
        # receiver there.
        holder = src if h == src_host else topology.peer_on(h, local)
        if h != src_host:
          network[holder] += 1
        for d in dests:
          if d != holder and (topology is None or topology.host_of(d) == h):
            peer[d] += 1
  return float(network.mean()), float(peer.mean())


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


_GATHERS: dict[str, int] = {}


def gather_max(key: str, value: float, timeout_s: float = 120) -> float:
  """The largest `value` over all processes (through the distributed key-value store): a
  multi-process op is done when its slowest process is. Every process makes the same calls
  in the same order; a key used again is numbered (the store refuses a key set twice)."""
  if jax.process_count() == 1:
    return value
  client = _kv_client()
  n = _GATHERS[key] = _GATHERS.get(key, 0) + 1
  key = f"{key}#{n}"
  client.key_value_set_bytes(f"bench/{key}/{jax.process_index()}", json.dumps(value).encode())
  return max(json.loads(client.blocking_key_value_get_bytes(f"bench/{key}/{p}",
                                                              int(timeout_s * 1000)))
             for p in range(jax.process_count()))


def barrier(key: str, timeout_s: float = 120) -> None:
  """Returns in every process once all have reached it (through the key-value store)."""
  if jax.process_count() == 1:
    return
  _kv_client().wait_at_barrier(f"bench/{key}", int(timeout_s * 1000))


def program_bytes(program, args) -> int | None:
  """The device memory XLA plans for one process's `program(*args)`: its arguments, outputs and
  temporaries (None where the backend does not say)."""
  try:
    stats = program.lower(*args).compile().memory_analysis()
  except Exception:  # noqa: BLE001 - the timed run reports the compile's error itself
    return None
  if stats is None:
    return None
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
          - stats.alias_size_in_bytes)


def gpu_share_bytes(sharing: int) -> tuple[int, int] | None:
  """(one process's share of its GPU, the GPU's memory): alone, XLA's allocator limit; shared
  by `sharing` processes, an equal part of the whole GPU, which is the limit over the fraction
  of it that XLA takes (`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 unless set). None where the
  device does not say."""
  limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
  if limit is None:
    return None
  whole = int(limit / float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))
  return (limit if sharing == 1 else whole // sharing, whole)


def comm_buffer_bytes(group) -> int:
  """A jax_ep group's own communication buffers (`Group.memory_bytes`), allocated beside XLA's;
  0 where the group cannot say."""
  try:
    return group.memory_bytes().comm_buffer_bytes
  except (ValueError, TypeError, NotImplementedError):
    return 0


def fits_gpu(program, args, key: str, what: str, *, sharing: int, reserved_bytes: int = 0,
             hint: str = "fewer tokens fit") -> bool:
  """Whether `program(*args)` (with `reserved_bytes` of buffers outside XLA's beside it) fits
  this process's share of its GPU (`sharing` processes on it), decided alike on every process:
  where it does not fit on one, every process is told False and the first says what it needs.
  It catches a plan that cannot fit; the CUDA contexts and command buffers beside it can still
  run a GPU out of memory.
  Processes that share a GPU would otherwise run out of its memory one by one, while the
  others wait for the first that failed until their calls time out. True off GPUs. `key` must
  be unique per call (`gather_max`)."""
  on_gpu = jax.devices()[0].platform == "gpu"
  need = program_bytes(program, args) if on_gpu else None
  share = gpu_share_bytes(sharing) if on_gpu else None
  over = need is not None and share is not None and need + reserved_bytes > share[0]
  if gather_max(f"{key}/too_big", float(over)) == 0:
    return True
  if over:
    print(f"{what}: skipped: it needs {need / 2**30:.1f} GiB a process (XLA's plan) and "
          f"{reserved_bytes / 2**30:.1f} GiB of buffers beside it, more than the "
          f"{share[0] / 2**30:.1f} GiB share of each of the {sharing} process(es) on this GPU "
          f"of {share[1] / 2**30:.0f} GiB: {hint}")
  return False
