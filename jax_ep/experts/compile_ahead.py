"""jax_ep's Mosaic GPU kernels compiled once a process, and ahead of the program that calls them.

XLA builds a program's Mosaic GPU kernels while it emits the program's thunks, one after
another on the compiling thread, each holding LLVM's command-line options lock, which XLA's
own kernel compiles on its thread pool then wait for (jaxlib's mosaic/gpu/custom_call.cc takes
`xla::llvm_ir::LLVMCommandLineOptionsLock` with its own options). A kernel once built is kept
for the process, keyed by the SHA-256 of its module's bytes; two things made every trace's
module new bytes, so that no program found a kernel another had built:
- Mosaic GPU names each module for its dumps with a number it counts up per process
  (`mosaic_gpu.dump_basename`, `<name>_<n>`), and
- the module's locations carry the traceback of the call that traced the kernel.

So, for jax_ep's kernels (modules named `jax_ep_*`) and unless a `MOSAIC_GPU_DUMP*` variable
is set (a dump keeps its numbered files and the locations):
- `stable_modules()`: the dump name is the kernel's name and the locations are stripped: the
  same kernel at the same shapes is the same bytes in every program, built once a process;
- `submit()` (from `hopper.launch`, which every persistent kernel goes through): a kernel
  traced inside a program is also compiled alone (a program of just that kernel, on abstract
  operands) on a pool thread, while the trace, the lowering and XLA's passes of the program go
  on; XLA's compile of the program then finds it built. Off with
  `jax_ep.experts.override(compile_ahead=False)`.

NOTES: Mosaic GPU reads the dump name through `get_or_set_dump_options(module)` of its dialect
module (jaxlib.mosaic.python.mosaic_gpu), after lowering a kernel and before hashing it;
`stable_modules` wraps that function, which sets the name only where none is set. A stripped
module's compile errors name no source line: jax_ep's kernels are fixed code, and a shape
whose kernel does not build is found by the choice's probe (`choice.mosaic_compile_error`),
whose error names the kernel and the shape.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading

import jax

from jax_ep.experts import configs

PREFIX = "jax_ep_"
_DUMP_NAME = "mosaic_gpu.dump_basename"
_LOCK = threading.Lock()
_STATE = {"stable": None, "pool": None}
# (kernel, operands) already compiled ahead, and the futures of those compiling.
_SUBMITTED: dict = {}


def dumping() -> bool:
  """Whether a `MOSAIC_GPU_DUMP*` variable asks Mosaic GPU for dumps: set at all, as Mosaic
  GPU reads them (set to an empty string too)."""
  return any(k.startswith("MOSAIC_GPU_DUMP") for k in os.environ)


def stable_modules() -> bool:
  """Makes jax_ep's kernel modules the same bytes in every trace (the module docstring), once
  a process; whether they are (False where a dump is asked for or Mosaic GPU's dialect has no
  `get_or_set_dump_options`)."""
  with _LOCK:
    if _STATE["stable"] is None:
      _STATE["stable"] = _install()
    return _STATE["stable"]


def _install() -> bool:
  if dumping():
    return False
  try:
    from jax._src.lib.mlir import ir, passmanager
    from jaxlib.mosaic.python import mosaic_gpu as dialect
  except ImportError:
    return False
  original = getattr(dialect, "get_or_set_dump_options", None)
  if original is None:
    return False

  def get_or_set_dump_options(module):
    attributes = module.operation.attributes
    name = ir.StringAttr(attributes["sym_name"]).value if "sym_name" in attributes else ""
    if name.startswith(PREFIX):
      if _DUMP_NAME not in attributes:
        attributes[_DUMP_NAME] = ir.StringAttr.get(name)
      passmanager.PassManager.parse("builtin.module(strip-debuginfo)",
                                    module.context).run(module.operation)
    return original(module)

  get_or_set_dump_options.__wrapped__ = original
  dialect.get_or_set_dump_options = get_or_set_dump_options
  return True


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  with _LOCK:
    if _STATE["pool"] is None:
      _STATE["pool"] = concurrent.futures.ThreadPoolExecutor(
          max_workers=max(2, min(8, os.cpu_count() or 2)),
          thread_name_prefix="jax_ep_compile_ahead")
    return _STATE["pool"]


def _compile(kernel, operands, device, overrides):
  # A pool thread sees neither the caller's default device (a compile-only one inside
  # `jax.default_device`, say) nor its `override` block: what the kernel's body reads of them
  # when traced again here must be the caller's, or its module is other bytes.
  fields = {f.name: getattr(overrides, f.name) for f in dataclasses.fields(overrides)}
  with jax.default_device(device), configs.override(**fields):
    jax.jit(kernel).trace(*operands).lower().compile()


def submit(key, kernel, args) -> concurrent.futures.Future | None:
  """Compiles `kernel` alone on `args`' shapes and dtypes on a pool thread, once per `key`
  (the kernel's name and settings: the same key is the same kernel): its future, or None where
  nothing was submitted (done before; off; the modules not stable; programs compiled for other
  devices than Hopper GPUs, where the kernels run interpreted if at all)."""
  # NOTES: configs' own check, not `choice.on_hopper`, which tests replace to run the Hopper
  # paths' kernels in the interpreter on the CPU: nothing is compiled ahead there.
  if not configs.on_hopper() or not stable_modules() or configs.current().compile_ahead is False:
    return None
  operands = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
  key = (key, operands)
  with _LOCK:
    if key in _SUBMITTED:
      return None
    _SUBMITTED[key] = None
  future = _pool().submit(_compile, kernel, operands, jax.config.jax_default_device,
                          configs.current())
  with _LOCK:
    _SUBMITTED[key] = future
  return future


def pending() -> list[concurrent.futures.Future]:
  """The compiles submitted so far (each future's exception is its compile's error)."""
  with _LOCK:
    return [f for f in _SUBMITTED.values() if f is not None]


def wait() -> None:
  """Waits for every compile submitted so far; a failed one is left to the program's own
  compile, which reports it."""
  concurrent.futures.wait(pending())


def code_key(fn) -> tuple:
  """A key for a kernel's epilogue `fn` among `submit`'s settings: its code and the plain
  values it closes over (an activation's name, say), so that a closure made again per trace
  is the same key and two activations' are not."""
  cells = tuple(c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                if isinstance(c.cell_contents, (str, int, float, bool, type(None))))
  return getattr(fn, "__code__", fn), cells
