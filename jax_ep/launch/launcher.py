"""Start N copies of a command wired together for `jax.distributed` on this host.

Usage::

    # Four CPU processes (one EP rank each) running the multi-process tests:
    JAX_PLATFORMS=cpu python -m jax_ep.launch -n 4 -- python -m pytest tests/test_multiprocess.py

    # One process per GPU (process i uses GPU i):
    python -m jax_ep.launch -n 8 -- python -m pytest tests/

    # One process per GPU, each seeing only its own GPU (as a scheduler that hands each task one
    # GPU through CUDA_VISIBLE_DEVICES does):
    python -m jax_ep.launch -n 8 --isolate-gpus -- python -m pytest tests/

    # Emulated multi-rank on one GPU: every process uses GPU 0 and a CUDA MPS daemon runs, so
    # their kernels execute concurrently (a rank spinning on a peer must not starve that peer):
    python -m jax_ep.launch -n 4 --share-gpu -- python -m pytest tests/test_multiprocess.py

Options::

    -n N           number of processes (required)
    --share-gpu    all processes use GPU 0, with a CUDA MPS daemon started for this run
    --isolate-gpus process i sees only the i-th visible GPU (CUDA_VISIBLE_DEVICES set per
                   process); needs at least N visible GPUs
    --port P       coordinator port on 127.0.0.1 (default: a free one)
    --grace S      once a process has failed, how long the others may run on before they are
                   killed (default 60 s)
    --timeout S    kill everything after S seconds (default: no limit)

Process `i` gets these environment variables; everything else is inherited unchanged (nothing
else is unset, so e.g. the caller's NVLink-multicast settings reach the children):

    JAX_EP_COORDINATOR       `127.0.0.1:PORT`
    JAX_EP_NUM_PROCESSES     `N`
    JAX_EP_PROCESS_ID        `i`
    JAX_EP_LOCAL_DEVICE_IDS  `0` with --share-gpu or --isolate-gpus; `i` when at least N GPUs
                             are visible; unset otherwise (CPU runs)
    CUDA_VISIBLE_DEVICES     with --isolate-gpus only: the i-th GPU the launcher could see
    JAX_EP_SHARED_GPU        `1` with --share-gpu (the processes cannot run XLA collectives)
    XLA_PYTHON_CLIENT_PREALLOCATE  `false` with --share-gpu, unless the caller set it or another
                             XLA_PYTHON_CLIENT_* allocator variable: N processes that each
                             preallocated 75% of the one GPU would run out of memory

A child joins the job with `jax_ep.launch.initialize_from_env()` (jax_ep/launch/env.py).
Every output line of process `i` is prefixed with `[i] `. The launcher's exit code is the first
non-zero exit code of a child (a child killed by signal `s` counts as `128 + s`); 124 when
`--timeout` expired before any child failed; else 0. Installed as the `jax-ep-launch` command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from jax_ep.launch.env import (CHILD_ENV_VARS, ENV_COORDINATOR, ENV_LOCAL_DEVICE_IDS,
                               ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_SHARED_GPU)

EXIT_USAGE = 2
EXIT_CANNOT_START = 127  # Shell convention for "command not found".
EXIT_INTERRUPTED = 130
EXIT_TIMEOUT = 124  # Convention of coreutils `timeout`.

_POLL_INTERVAL_S = 0.05
# After SIGTERM to a process group, how long before SIGKILL follows.
_TERM_TO_KILL_S = 3.0


def _log(msg: str) -> None:
  print(f"[launch] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _visible_gpu_ids() -> list[str]:
  """GPUs the children could use, as CUDA_VISIBLE_DEVICES entries; [] when `nvidia-smi -L` is
  missing or fails."""
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return []
  if out.returncode != 0:
    return []
  num_gpus = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is None:
    return [str(i) for i in range(num_gpus)]
  # The caller's selection (ordinals or UUIDs), no more entries than GPUs exist.
  return [v.strip() for v in visible.split(",") if v.strip()][:num_gpus]


def _num_visible_gpus() -> int:
  """GPUs the children could use; 0 when `nvidia-smi -L` is missing or fails. Local device ids
  index the visible GPUs, not the physical ones."""
  return len(_visible_gpu_ids())


class _Mps:
  """A CUDA MPS control daemon with private pipe and log directories."""

  def __init__(self) -> None:
    self.pipe_dir = tempfile.mkdtemp(prefix="jax_ep_mps_pipe_")
    self.log_dir = tempfile.mkdtemp(prefix="jax_ep_mps_log_")
    self.env = {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir,
                "CUDA_MPS_LOG_DIRECTORY": self.log_dir}
    self.started = False

  def _control(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["nvidia-cuda-mps-control", *args], input=stdin,
                          env={**os.environ, **self.env}, capture_output=True, text=True,
                          timeout=60)

  def start(self) -> None:
    out = self._control(["-d"])
    if out.returncode != 0:
      raise RuntimeError(f"`nvidia-cuda-mps-control -d` failed with exit code "
                         f"{out.returncode}: {(out.stdout + out.stderr).strip()}")
    self.started = True
    _log(f"CUDA MPS started (CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir})")

  def stop(self) -> None:
    try:
      if self.started:
        self.started = False
        out = self._control([], stdin="quit\n")
        if out.returncode != 0:
          _log(f"stopping CUDA MPS failed with exit code {out.returncode}: "
               f"{(out.stdout + out.stderr).strip()}")
        else:
          _log("CUDA MPS stopped")
    finally:
      shutil.rmtree(self.pipe_dir, ignore_errors=True)
      shutil.rmtree(self.log_dir, ignore_errors=True)


class _Child:
  """One launched process, plus the threads that copy its output with a `[i] ` prefix."""

  def __init__(self, index: int, cmd: Sequence[str], env: dict[str, str],
               out_lock: threading.Lock) -> None:
    self.index = index
    self.killed = False
    # A new session makes the child the leader of its own process group, so killing the
    # group also reaches whatever it started (pytest workers, shells, ...).
    self.proc = subprocess.Popen(list(cmd), env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
    self.threads = [
        threading.Thread(target=self._copy, args=(self.proc.stdout, sys.stdout, out_lock),
                         daemon=True),
        threading.Thread(target=self._copy, args=(self.proc.stderr, sys.stderr, out_lock),
                         daemon=True),
    ]
    for t in self.threads:
      t.start()

  def _copy(self, src: IO[bytes], dst: IO[str], lock: threading.Lock) -> None:
    prefix = f"[{self.index}] "
    for raw in iter(src.readline, b""):
      line = raw.decode("utf-8", errors="replace")
      if not line.endswith("\n"):
        line += "\n"
      with lock:
        dst.write(prefix + line)
        dst.flush()
    src.close()

  def signal_group(self, sig: int) -> None:
    try:
      os.killpg(self.proc.pid, sig)
    except (ProcessLookupError, PermissionError):
      pass

  def exit_code(self) -> int | None:
    """The exit code, None while running; 128 + s for a child killed by signal s."""
    rc = self.proc.poll()
    if rc is None:
      return None
    return 128 - rc if rc < 0 else rc


def _kill_all(children: Sequence[_Child]) -> None:
  running = [c for c in children if c.proc.poll() is None]
  for c in running:
    c.killed = True
    c.signal_group(signal.SIGTERM)
  deadline = time.monotonic() + _TERM_TO_KILL_S
  while time.monotonic() < deadline and any(c.proc.poll() is None for c in running):
    time.sleep(_POLL_INTERVAL_S)
  for c in running:
    # SIGKILL the group even when its leader is gone: descendants may hold the pipes open.
    c.signal_group(signal.SIGKILL)
    c.proc.wait()


def _supervise(children: Sequence[_Child], grace_s: float, timeout_s: float | None) -> int:
  """Waits for the children, killing them when needed; returns the launcher's exit code."""
  overall_deadline = time.monotonic() + timeout_s if timeout_s is not None else None
  first_failure: int | None = None
  failure_deadline: float | None = None
  while True:
    # NOTES: one reading of every child's state per turn, used both for the failure and for
    # "all exited". Reading the codes and then asking again whether all have exited let a
    # child that failed between the two readings end the loop unrecorded (exit code 0).
    codes = [c.exit_code() for c in children]
    for c, rc in zip(children, codes):
      if rc and first_failure is None:
        first_failure = rc
        failure_deadline = time.monotonic() + grace_s
        if any(code is None for code in codes):
          _log(f"process {c.index} exited with code {rc}; the others get "
               f"{grace_s:g} s to finish")
    if all(code is not None for code in codes):
      break
    now = time.monotonic()
    if overall_deadline is not None and now >= overall_deadline:
      _log(f"--timeout {timeout_s:g} s passed; killing the remaining processes")
      _kill_all(children)
      return first_failure if first_failure is not None else EXIT_TIMEOUT
    if failure_deadline is not None and now >= failure_deadline:
      _log(f"grace period of {grace_s:g} s passed; killing the remaining processes")
      _kill_all(children)
      break
    time.sleep(_POLL_INTERVAL_S)
  return first_failure if first_failure is not None else 0


def child_env(base_env: dict[str, str], process_id: int, *, share_gpu: bool,
              gpu_per_process: bool,
              isolated_gpus: Sequence[str] | None = None) -> dict[str, str]:
  """The environment of child `process_id` (see the module docstring for the variables).

  `isolated_gpus`: with --isolate-gpus, the GPUs the launcher could see (CUDA_VISIBLE_DEVICES
  entries, or ordinals); child i is given entry i as its only visible GPU.
  """
  env = dict(base_env)
  env[ENV_PROCESS_ID] = str(process_id)
  if isolated_gpus is not None:
    env["CUDA_VISIBLE_DEVICES"] = isolated_gpus[process_id]
    env[ENV_LOCAL_DEVICE_IDS] = "0"
  elif share_gpu:
    env[ENV_LOCAL_DEVICE_IDS] = "0"
    env[ENV_SHARED_GPU] = "1"  # tests skip what needs XLA collectives (NCCL refuses)
    if not any(k.startswith("XLA_PYTHON_CLIENT_") for k in base_env):
      env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  elif gpu_per_process:
    env[ENV_LOCAL_DEVICE_IDS] = str(process_id)
  return env


def launch(cmd: Sequence[str], num_processes: int, *, share_gpu: bool = False,
           isolate_gpus: bool = False, port: int | None = None, grace_s: float = 60.0,
           timeout_s: float | None = None) -> int:
  """Runs `num_processes` copies of `cmd` as one `jax.distributed` job.

  Returns:
    The launcher's exit code (see the module docstring).
  """
  if num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if not cmd:
    raise ValueError("cmd is empty: nothing to launch")
  if share_gpu and isolate_gpus:
    raise ValueError("share_gpu and isolate_gpus exclude each other: one GPU for all processes, "
                     "or one GPU each")
  base_env = dict(os.environ)
  # What an enclosing launcher set describes that job, not this one (e.g. JAX_EP_SHARED_GPU
  # would make this job's tests skip what it can run).
  for name in CHILD_ENV_VARS:
    base_env.pop(name, None)
  base_env[ENV_COORDINATOR] = f"127.0.0.1:{port if port is not None else _free_port()}"
  base_env[ENV_NUM_PROCESSES] = str(num_processes)
  # Unbuffered Python output, so the lines of different processes interleave as they happen.
  base_env.setdefault("PYTHONUNBUFFERED", "1")

  gpu_per_process = False
  isolated_gpus: list[str] | None = None
  mps: _Mps | None = None
  if isolate_gpus:
    isolated_gpus = _visible_gpu_ids()
    if len(isolated_gpus) < num_processes:
      _log(f"error: --isolate-gpus needs a GPU for each of the {num_processes} processes, "
           f"but {len(isolated_gpus)} are visible")
      return EXIT_USAGE
  elif share_gpu:
    if shutil.which("nvidia-cuda-mps-control") is None:
      _log("error: --share-gpu needs CUDA MPS, but `nvidia-cuda-mps-control` is not on "
           "PATH")
      return EXIT_USAGE
    mps = _Mps()
    base_env.update(mps.env)
  else:
    num_gpus = _num_visible_gpus()
    gpu_per_process = num_gpus >= num_processes
    if 0 < num_gpus < num_processes:
      _log(f"{num_gpus} GPU(s) visible for {num_processes} processes: not assigning GPUs "
           "(--share-gpu runs all processes on GPU 0)")

  children: list[_Child] = []
  out_lock = threading.Lock()
  try:
    if mps is not None:
      try:
        mps.start()
      except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        _log(f"error: {e}")
        return EXIT_USAGE
    for i in range(num_processes):
      env = child_env(base_env, i, share_gpu=share_gpu, gpu_per_process=gpu_per_process,
                      isolated_gpus=isolated_gpus)
      try:
        children.append(_Child(i, cmd, env, out_lock))
      except OSError as e:
        _log(f"error: cannot start {cmd[0]!r}: {e}")
        code = EXIT_CANNOT_START
        break
    else:
      code = _supervise(children, grace_s, timeout_s)
  except KeyboardInterrupt:
    _log("interrupted; killing all processes")
    code = EXIT_INTERRUPTED
  finally:
    # Reached on every path, KeyboardInterrupt included.
    _kill_all(children)
    for c in children:
      for t in c.threads:
        t.join(timeout=5.0)
    if mps is not None:
      mps.stop()

  for c in children:
    note = " (killed by the launcher)" if c.killed else ""
    _log(f"process {c.index}: exit code {c.exit_code()}{note}")
  return code


def _parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  argv = list(argv)
  if "--" in argv:
    split = argv.index("--")
    own, cmd = argv[:split], argv[split + 1:]
  else:
    own, cmd = argv, []
  parser = argparse.ArgumentParser(
      prog="python -m jax_ep.launch",
      usage="%(prog)s -n N [--share-gpu | --isolate-gpus] [--port P] [--grace S] [--timeout S] "
            "-- CMD...",
      description="Start N copies of CMD wired for jax.distributed on 127.0.0.1.")
  parser.add_argument("-n", "--num-processes", type=int, required=True,
                      help="number of processes")
  parser.add_argument("--share-gpu", action="store_true",
                      help="all processes use GPU 0, with CUDA MPS running")
  parser.add_argument("--isolate-gpus", action="store_true",
                      help="process i sees only the i-th visible GPU (CUDA_VISIBLE_DEVICES)")
  parser.add_argument("--port", type=int, default=None,
                      help="coordinator port (default: a free one)")
  parser.add_argument("--grace", type=float, default=60.0,
                      help="seconds the others may run on once a process failed (default 60)")
  parser.add_argument("--timeout", type=float, default=None,
                      help="kill everything after this many seconds (default: no limit)")
  args = parser.parse_args(own)
  if not cmd:
    parser.error("missing command: put it after `--`")
  if args.num_processes < 1:
    parser.error(f"-n must be >= 1, got {args.num_processes}")
  if args.share_gpu and args.isolate_gpus:
    parser.error("--share-gpu and --isolate-gpus exclude each other")
  return args, cmd


def _raise_interrupt(signum: int, frame: object) -> None:
  raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
  args, cmd = _parse_args(sys.argv[1:] if argv is None else argv)
  # A launcher that is itself terminated (e.g. by a CI time limit) takes its children with it
  # rather than leaving them orphaned.
  signal.signal(signal.SIGTERM, _raise_interrupt)
  return launch(cmd, args.num_processes, share_gpu=args.share_gpu,
                isolate_gpus=args.isolate_gpus, port=args.port, grace_s=args.grace,
                timeout_s=args.timeout)
