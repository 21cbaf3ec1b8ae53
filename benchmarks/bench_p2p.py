"""NVLink between two GPUs: copy engine and SM stores, one direction and both at once.

  CUDA_VISIBLE_DEVICES=0,1 python benchmarks/bench_p2p.py

What the peer transport's all-to-all can expect of the wire: every rank sends and receives at
once, and its rows move as 16-byte SM stores from a bounded grid (the group's `num_sms`: that
many SMs' worth of blocks, 1024 threads per SM), not as copy-engine copies. The store kernel
here is launched in the same shape, `--sms N` giving N * 1024 threads in blocks of 128. Like the
transport's grid, it is a thread budget: the scheduler may spread the blocks over more than N
SMs when nothing else runs. For each setting, the bytes one GPU moves to the other per second
(per direction), each run `--bytes` (1 GiB); the median of 6 runs after 2 warm-ups, on the host
clock around launches issued on one non-blocking stream per GPU, both GPUs synchronised before
and after (~3 ms per run, so the clock's overhead is under 1 %). Records go to
benchmarks/results/p2p.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import reports  # noqa: E402

# A grid-stride copy, four 16-byte vectors in flight per thread: the shape of the transport's
# row pushes without their bookkeeping.
_PUSH = r"""
struct __align__(16) Vec { unsigned a, b, c, d; };
extern "C" __global__ void push(const Vec* __restrict__ src, Vec* __restrict__ dst,
                                long long n) {
  const long long stride = (long long)gridDim.x * blockDim.x * 4;
  for (long long base = (long long)blockIdx.x * blockDim.x * 4 + threadIdx.x; base < n;
       base += stride) {
    Vec v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const long long i = base + u * blockDim.x;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const long long i = base + u * blockDim.x;
      if (i < n) dst[i] = v[u];
    }
  }
}
"""
_THREADS = 128
_BLOCKS_PER_SM = 8  # 1024 threads per SM, as the transport's send kernels


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--bytes", type=int, default=1 << 30)
  parser.add_argument("--sms", type=int, nargs="+", default=[8, 16, 24, 32, 48, 96, 0],
                      help="the store kernel's grid in SMs' worth of blocks (0: every SM)")
  parser.add_argument("--out", default="p2p.jsonl")
  args = parser.parse_args()
  try:
    import cupy as cp
  except ImportError:
    raise SystemExit("bench_p2p.py needs CuPy and two GPUs (CuPy is not installed)") from None
  if args.bytes <= 0 or args.bytes % 16:
    parser.error(f"--bytes must be a positive multiple of 16, got {args.bytes}")
  if cp.cuda.runtime.getDeviceCount() < 2:
    raise SystemExit("bench_p2p.py needs two visible GPUs (CUDA_VISIBLE_DEVICES=0,1)")
  for a, b in ((0, 1), (1, 0)):
    if not cp.cuda.runtime.deviceCanAccessPeer(a, b):
      raise SystemExit(f"GPU {a} cannot access GPU {b} directly")
  all_sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]
  if any(n < 0 or n > all_sms for n in args.sms):
    parser.error(f"--sms entries must be 0 (every SM) to {all_sms}, got {args.sms}")
  src, dst, stream, kernel = {}, {}, {}, {}
  for d in (0, 1):
    with cp.cuda.Device(d):
      try:
        cp.cuda.runtime.deviceEnablePeerAccess(1 - d)
      except cp.cuda.runtime.CUDARuntimeError as e:
        if e.status != 704:  # cudaErrorPeerAccessAlreadyEnabled
          raise
      src[d] = cp.ones(args.bytes, dtype=cp.uint8)
      dst[d] = cp.empty(args.bytes, dtype=cp.uint8)  # the other GPU writes it
      stream[d] = cp.cuda.Stream(non_blocking=True)
      kernel[d] = cp.RawKernel(_PUSH, "push")

  def gbps(directions, engine, num_sms=0):
    def issue(d):
      with cp.cuda.Device(d):
        if engine == "copy_engine":
          cp.cuda.runtime.memcpyPeerAsync(dst[1 - d].data.ptr, 1 - d, src[d].data.ptr, d,
                                          args.bytes, stream[d].ptr)
        else:
          kernel[d]((num_sms * _BLOCKS_PER_SM,), (_THREADS,),
                    (src[d], dst[1 - d], cp.int64(args.bytes // 16)), stream=stream[d])
    times = []
    for _ in range(8):
      for d in (0, 1):
        stream[d].synchronize()
      start = time.perf_counter()
      for d in directions:
        issue(d)
      for d in directions:
        stream[d].synchronize()
      times.append(time.perf_counter() - start)
    return args.bytes / statistics.median(times[2:]) / 1e9

  # The contract's record fields, without starting JAX's GPU backend in this CuPy process.
  base = dict(gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              jax=importlib.metadata.version("jax"), date=datetime.date.today().isoformat(),
              commit=reports.git_commit())
  records = []
  settings = [("copy_engine", 0)] + [("sm_stores", n or all_sms) for n in args.sms]
  print(f"{'engine':12s} {'SMs':>4s} {'one direction':>14s} {'both directions':>16s}  (GB/s each way)")
  for engine, num_sms in settings:
    one, both = gbps((0,), engine, num_sms), gbps((0, 1), engine, num_sms)
    print(f"{engine:12s} {num_sms or '':>4} {one:14.1f} {both:16.1f}")
    for directions, value in (("one", one), ("both", both)):
      records.append(dict(base, op="p2p_copy", engine=engine, num_sms=num_sms or None,
                          directions=directions, bytes=args.bytes, gbps=round(value, 1),
                          timing="host_clock"))
  print("wrote", reports.write_jsonl(records, args.out))


if __name__ == "__main__":
  main()
