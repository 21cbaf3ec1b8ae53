"""Hardware bounds the benchmarks compare with: the device-to-device copy bandwidth of one GPU and
the NVLink line rate between two, each measured in a child process (CuPy) so that its CUDA
context and allocator stay away from XLA's.
"""

from __future__ import annotations

import os
import subprocess

import jax

from timers import time_batches

_COPY_PROBE = """
import statistics, sys
import cupy
num_bytes = int(sys.argv[1])
src = cupy.empty(num_bytes // 2, dtype=cupy.uint8)
dst = cupy.empty_like(src)
src.fill(1)
start, stop = cupy.cuda.Event(), cupy.cuda.Event()
times = []
for _ in range(12):
  start.record()
  cupy.cuda.runtime.memcpy(dst.data.ptr, src.data.ptr, src.nbytes, 3)  # device to device
  stop.record()
  stop.synchronize()
  times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
print(2 * src.nbytes / statistics.median(times[2:]) / 1e9)
"""



def copy_bound_gbps(num_bytes: int | None = None) -> tuple[float, str]:
  """Device-to-device copy bandwidth (bytes read + written per second), and how it was measured.

  `cudaMemcpy` through CuPy in a child process (the contract's bound; a separate process keeps
  CuPy's CUDA context and allocator away from XLA's), else an XLA copy, which reads lower.
  """
  import sys
  if num_bytes is None:  # a few GiB on a GPU (far past L2); small elsewhere (a CPU smoke run)
    num_bytes = 4 << 30 if jax.devices()[0].platform == "gpu" else 64 << 20
  try:
    out = subprocess.run([sys.executable, "-c", _COPY_PROBE, str(num_bytes)], text=True,
                         capture_output=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1]), "cudaMemcpy"
  except (OSError, ValueError, IndexError, subprocess.SubprocessError):
    x = jax.numpy.ones((num_bytes // 8,), jax.numpy.float32)
    copy = jax.jit(lambda v: v * 1.0)
    seconds, _ = time_batches(copy, (x,), repeats=10)
    return 2 * x.nbytes / seconds / 1e9, "xla_copy"



_P2P_PROBE = """
import statistics, sys
import cupy
num_bytes = int(sys.argv[1])
with cupy.cuda.Device(1):
  dst = cupy.empty(num_bytes, dtype=cupy.uint8)
if not cupy.cuda.runtime.deviceCanAccessPeer(0, 1):
  sys.exit("GPU 0 cannot access GPU 1 directly (a copy would be staged through the host)")
with cupy.cuda.Device(0):
  try:
    cupy.cuda.runtime.deviceEnablePeerAccess(1)
  except cupy.cuda.runtime.CUDARuntimeError as e:
    if e.status != 704:  # cudaErrorPeerAccessAlreadyEnabled
      raise
  src = cupy.empty(num_bytes, dtype=cupy.uint8)
  src.fill(1)
  stream = cupy.cuda.get_current_stream()
  start, stop = cupy.cuda.Event(), cupy.cuda.Event()
  times = []
  for _ in range(12):
    start.record()
    cupy.cuda.runtime.memcpyPeerAsync(dst.data.ptr, 1, src.data.ptr, 0, num_bytes, stream.ptr)
    stop.record()
    stop.synchronize()
    times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
print(num_bytes / statistics.median(times[2:]) / 1e9)
"""



def narrowed_to_one_gpu() -> bool:
  """Whether CUDA_VISIBLE_DEVICES names exactly one GPU, as `launch --isolate-gpus` sets it."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  return visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1



def p2p_line_rate_gbps(num_bytes: int = 1 << 30) -> float | None:
  """One-direction GPU 0 -> GPU 1 copy bandwidth (bytes moved per second), the line rate the
  multi-GPU records compare with; None with fewer than two GPUs, without direct peer access or
  without CuPy. A child process, as for the copy bound. It sees every GPU of the host when this
  process was narrowed to one (`launch --isolate-gpus`): the line is the host's, not the
  process's."""
  import sys
  env = dict(os.environ)
  if narrowed_to_one_gpu():
    del env["CUDA_VISIBLE_DEVICES"]
  try:
    out = subprocess.run([sys.executable, "-c", _P2P_PROBE, str(num_bytes)], text=True,
                         capture_output=True, timeout=120, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])
  except (OSError, ValueError, IndexError, subprocess.SubprocessError):
    return None
