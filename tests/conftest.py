"""Test set-up: 8 host devices on the CPU, and `jax.distributed` when started by jax_ep.launch.

Also: on a machine without a GPU, XLA's CPU backend compiles without LLVM optimisation and
with its older fusion emitter (the tests' programs are small, and compiling is most of their
time), and compiled programs are shared between the tests of one run through a persistent
compilation cache; the `ranks` marker generates only the rank counts this run can build;
GPU-only tests are skipped where there is no GPU (and fail the run where JAX_EP_REQUIRE_GPU=1
says there must be one); with several pytest-xdist workers the slow
tests start first; after a failure, the failed test's values are released before the next
test runs.
"""

import atexit
import gc
import glob
import os
import re
import shutil
import sys
import tempfile
import time

# Must happen before jax is imported anywhere: 8 host devices stand in for 8 EP ranks on the CPU.
# Under jax_ep.launch each process is one rank with its own device instead.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags and "JAX_EP_PROCESS_ID" not in os.environ:
  _flags += " --xla_force_host_platform_device_count=8"
# Where there is no NVIDIA GPU (the CPU suite; a GPU machine's runs are left as they are):
_CPU_ONLY = (os.environ.get("JAX_PLATFORMS", "").lower() == "cpu"
             or not glob.glob("/dev/nvidia[0-9]*"))
if _CPU_ONLY and "xla_backend_extra_options" not in _flags:
  # XLA's CPU backend emits each fusion with its older LLVM IR emitter instead of the MLIR
  # fusion emitters, which create and destroy MLIR contexts in every compilation: the same HLO,
  # each op's code from the older emitter, about half the compile time of these tests' small
  # programs. Also in the processes of a job started by jax_ep.launch (this file adds it there).
  _flags += " --xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters"
if (not _CPU_ONLY and "xla_gpu_autotune_level" not in _flags
    and os.environ.get("JAX_EP_TEST_AUTOTUNE", "0") != "1"):
  # On a GPU, XLA's own GEMMs and fusions (the dense models the tests compare with, the
  # fallbacks) take cuBLAS's and the emitters' default choices instead of timing candidates
  # during each compile: the tests check results, not XLA's speed, and the timing is a large
  # part of compiling their programs at model shapes. jax_ep's kernels are not autotuned by XLA
  # either way. JAX_EP_TEST_AUTOTUNE=1 (or an autotune level in XLA_FLAGS) keeps XLA's default.
  _flags += " --xla_gpu_autotune_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
if _CPU_ONLY:
  # XLA's CPU backend generates code without LLVM's optimisation passes
  # (--xla_backend_optimization_level=0, --xla_llvm_disable_expensive_passes): the same HLO
  # (every XLA pass still runs), IEEE arithmetic either way (fast math is off by default), about
  # a third less compile time, which is most of these tests' time. Set through jax's variable,
  # not XLA_FLAGS, so that the processes the tests start inherit it whatever XLA_FLAGS they pass.
  # JAX_DISABLE_MOST_OPTIMIZATIONS=0 compiles as users do.
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# One persistent compilation cache per run, shared by its processes (pytest-xdist's workers
# inherit the directory through the environment; the process that created it removes it when
# it exits): tests that build the same program (same shapes, other values) compile it once.
# The processes of a job started by jax_ep.launch each use a directory of their own.
# JAX_EP_TEST_COMPILATION_CACHE=off compiles every program; a directory keeps the cache there.
_CACHE_ENV = "JAX_EP_TEST_COMPILATION_CACHE"
# JAX_EP_TEST_SHARED_COMPILE=1 (a launched job on GPUs; it needs the cache): a program over
# every process is compiled by the first process alone, and the others load its executable
# through jax.distributed's key-value store (jax_share_binary_between_hosts), where each
# process would otherwise compile it beside the others on the machine's CPUs. A process whose
# cache key differs from the first's waits for the limit set below, then fails.
SHARED_COMPILE = (os.environ.get("JAX_EP_TEST_SHARED_COMPILE") == "1" and not _CPU_ONLY
                  and "JAX_EP_PROCESS_ID" in os.environ)
if (_CPU_ONLY or SHARED_COMPILE) and os.environ.get(_CACHE_ENV) is None:
  os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jax_ep_test_cache_")
  atexit.register(shutil.rmtree, os.environ[_CACHE_ENV], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

from jax_ep import launch  # noqa: E402

if os.environ.get(_CACHE_ENV, "off") != "off":
  _cache_dir = os.environ[_CACHE_ENV]
  if "JAX_EP_PROCESS_ID" in os.environ:
    # (No JAX_EP_TEST_SHARED_COMPILE on the CPU: there each process's cache key of a program
    # over several processes differs, so the others would wait for a key never set.)
    _cache_dir = os.path.join(_cache_dir, "process-" + os.environ["JAX_EP_PROCESS_ID"])
  jax.config.update("jax_compilation_cache_dir", _cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

launch.initialize_from_env()

if SHARED_COMPILE and os.environ.get(_CACHE_ENV) != "off":
  jax.config.update("jax_share_binary_between_hosts", True)
  jax.config.update("jax_share_binary_between_hosts_timeout_ms", 240_000)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
  # JAX_EP_JUNIT_PREFIX (scripts/gpu_suite.py): each process of a launched job writes its own
  # junit report, PREFIX.pN.xml for process N, before pytest's junitxml plugin reads the path.
  prefix = os.environ.get("JAX_EP_JUNIT_PREFIX")
  if prefix and not config.option.xmlpath:
    config.option.xmlpath = f"{prefix}.p{os.environ.get('JAX_EP_PROCESS_ID', '0')}.xml"


# CUDA errors after which the process's context is lost: every later GPU call fails with the
# same error, so the tests after it say nothing (and take the suite's time).
_STICKY_CUDA_ERRORS = re.compile(
    r"CUDA_ERROR_(MISALIGNED_ADDRESS|ILLEGAL_ADDRESS|LAUNCH_FAILED|ILLEGAL_INSTRUCTION"
    r"|HARDWARE_STACK_ERROR|INVALID_PC)|cudaError(MisalignedAddress|IllegalAddress"
    r"|LaunchFailure|IllegalInstruction|HardwareStackError|InvalidPc)\b")
_SESSION = []
_FAILED_SINCE_COLLECT = []


def pytest_sessionstart(session):
  _SESSION.append(session)


def pytest_runtest_logreport(report):
  if not report.failed:
    return
  _FAILED_SINCE_COLLECT.append(True)
  # Under scripts/gpu_suite.py each failure goes to the log as it happens: a suite cut by its
  # time limit (or a crash) prints no summary, and its junit report may never be written.
  if os.environ.get("JAX_EP_JUNIT_PREFIX"):
    sys.stderr.write(f"\n{time.strftime('%H:%M:%S')} FAILED {report.nodeid} ({report.when})\n"
                     f"{report.longreprtext}\n")
    sys.stderr.flush()
  sticky = _STICKY_CUDA_ERRORS.search(report.longreprtext)
  if sticky and _SESSION:
    _SESSION[-1].shouldstop = (f"{report.nodeid} lost this process's CUDA context "
                               f"({sticky.group(0)}): the tests after it would fail with it")


def pytest_runtest_setup(item):
  # A failed test's frames, and with them its device arrays, outlive it: pytest keeps the last
  # failure for post-mortem debugging (sys.last_traceback) and its report's machinery leaves
  # reference cycles. At the models' shapes those arrays are tens of GB, so the next GPU test
  # would run out of memory because of the one before it: after a failure, drop them first.
  del item
  if _FAILED_SINCE_COLLECT:
    _FAILED_SINCE_COLLECT.clear()
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
      if hasattr(sys, name):
        delattr(sys, name)
    gc.collect()


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc):
  """`@pytest.mark.ranks(argnames, values, count=...)`: `parametrize(argnames, values)` with only
  the values whose rank count this process can run (the `rank_counts` of the class's `target`,
  when it has one, and enough devices in the job; see `ep_test_base.rank_count_runs`). The rank
  count of a value is its first element, or `count(*value)`. A test left with none is one
  skipped item that says why."""
  marker = metafunc.definition.get_closest_marker("ranks")
  if marker is None:
    return
  from ep_test_base import rank_count_runs
  argnames, values = marker.args
  count = marker.kwargs.get("count", lambda first, *rest: first)
  names = [n.strip() for n in argnames.split(",")]
  allowed = getattr(getattr(metafunc.cls, "target", None), "rank_counts", None)

  def ranks_of(value):
    params = value.values if hasattr(value, "values") else (
        tuple(value) if len(names) > 1 else (value,))
    return count(*params)

  wanted = sorted({ranks_of(v) for v in values})
  runnable = [v for v in values
              if (allowed is None or ranks_of(v) in allowed) and rank_count_runs(ranks_of(v))]
  if not runnable:
    why = (f"runs at R in {wanted}; this process runs R in "
           f"{[r for r in wanted if rank_count_runs(r)]}"
           + (f" and the class R in {list(allowed)}" if allowed is not None else "")
           + f" ({len(jax.devices())} devices, {jax.process_count()} processes)")
    metafunc.parametrize(argnames, [pytest.param(*[None] * len(names), id="no-rank-count",
                                                 marks=pytest.mark.skip(reason=why))])
    return
  metafunc.parametrize(argnames, runnable)


def pytest_collection_modifyitems(config, items):
  # With several workers (pytest-xdist), the long tests start first so that none is left
  # running alone at the end; the order is the same on every worker, as xdist requires.
  if config.getoption("numprocesses", None):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
  from jax_ep._native import ffi as _ffi
  if _ffi.cuda_available():
    return
  gpu_items = [item for item in items if "gpu" in item.keywords]
  if gpu_items and os.environ.get("JAX_EP_REQUIRE_GPU") == "1":
    # The GPU round: a machine that should run these tests and cannot (a stale or mismatched
    # extension, no GPU visible) fails the run, saying why, instead of skipping them all.
    raise pytest.UsageError(f"JAX_EP_REQUIRE_GPU=1, but {len(gpu_items)} GPU tests cannot run "
                            f"here: {_ffi.why_unavailable()}")
  skip = pytest.mark.skip(reason="needs a CUDA GPU and the jax_ep CUDA extension")
  for item in gpu_items:
    item.add_marker(skip)
