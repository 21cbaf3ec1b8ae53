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
  and lowered once a process: the lowering of a kernel's body to its Mosaic GPU module (Python,
  most of a program's tracing and lowering time where it calls several kernels) is kept by the
  exact text of the body's jaxpr and what else the lowering reads, and a program that lowers
  the same kernel again reads the module back (`_lowered_once`);
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

import collections
import concurrent.futures
import dataclasses
import hashlib
import io
import os
import re
import sys
import threading

import jax
import numpy as np

from jax_ep.experts import configs

PREFIX = "jax_ep_"
_DUMP_NAME = "mosaic_gpu.dump_basename"
_LOCK = threading.Lock()
_STATE = {"stable": None, "pool": None, "lowered": 0, "read_back": 0}
# (kernel, operands) already compiled ahead, and the futures of those compiling.
_SUBMITTED: dict = {}
# Lowered kernel modules: key -> (the module's bytecode, the lowering's other results), the
# most recently used last.
_LOWERED: collections.OrderedDict = collections.OrderedDict()
_LOWERED_LIMIT = 256
# Lowerings under way: key -> the event set when it is done (kept or failed).
_LOWERING: dict = {}
_LOWERING_WAIT_S = 60.0


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
  _lowered_once()
  return True


def _lowered_once() -> None:
  """Keeps jax_ep's kernels' lowered modules for the process: wraps the Mosaic GPU lowering of
  a kernel's jaxpr (`lower_unpipelined_jaxpr_to_module`, through which `plgpu.kernel`'s bodies
  go), which the kernel's lowering rule looks up when it runs. Only with stable modules: a
  module read back must be the bytes the lowering would make again (no locations). A lowering
  that another thread has under way is waited for, not done twice: the pool's lowering of a
  kernel and the program's are the same work, and both need the GIL."""
  try:
    from jax._src.lib.mlir import ir
    from jax._src.pallas.mosaic_gpu import lowering
  except ImportError:
    return
  original = getattr(lowering, "lower_unpipelined_jaxpr_to_module", None)
  if original is None or getattr(original, "__wrapped__", None) is not None:
    return

  def lower_unpipelined_jaxpr_to_module(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes,
                                        params, **kwargs):
    key = _lowering_key(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, kwargs)
    if key is None:
      return original(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs)
    with _LOCK:
      under_way = _LOWERING.get(key)
    if under_way is not None:
      # Past the limit (or where the other lowering failed) this thread lowers it itself.
      under_way.wait(timeout=_LOWERING_WAIT_S)
    with _LOCK:
      hit = _LOWERED.get(key)
      if hit is not None:
        _LOWERED.move_to_end(key)
        _STATE["read_back"] += 1
      else:
        _STATE["lowered"] += 1
        done = threading.Event()
        _LOWERING.setdefault(key, done)
    if hit is not None:
      bytecode, rest = hit
      # Into the MLIR context of the program being lowered (the ambient one), where the
      # lowering itself creates its module.
      return dataclasses.replace(rest, module=ir.Module.parse(bytecode))
    try:
      result = original(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs)
      if result.profiler_spec is None:
        buffer = io.BytesIO()
        result.module.operation.write_bytecode(buffer)
        with _LOCK:
          _LOWERED[key] = (buffer.getvalue(), dataclasses.replace(result, module=None))
          while len(_LOWERED) > _LOWERED_LIMIT:
            _LOWERED.popitem(last=False)
      return result
    finally:
      with _LOCK:
        if _LOWERING.get(key) is done:
          del _LOWERING[key]
      done.set()

  lower_unpipelined_jaxpr_to_module.__wrapped__ = original
  lowering.lower_unpipelined_jaxpr_to_module = lower_unpipelined_jaxpr_to_module


def _lowering_key(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, kwargs):
  """What the lowering of a jax_ep kernel reads, hashed (None for other kernels and where it
  cannot be keyed): the body's jaxpr as text (every equation, its parameters and nested
  jaxprs in full, its effects) and its nested jaxprs' constants, the operands' and results'
  types, the kernel's mesh, the program's mesh, the compiler parameters, the devices compiled
  for and the switches of jax and Mosaic GPU that lowering may read. The caller's traceback is
  left out: stable modules strip the locations it gives.

  NOTES: the program's mesh enters the module through its size (peers, where Mosaic GPU
  passes them as parameters), whether it spans hosts, and axes the body names. A mesh of one
  device whose axes the body does not name therefore lowers as no mesh does, and keys as
  none: the pool's lowering of a kernel (a program of that kernel alone) is then the one-rank
  program's."""
  name = getattr(jaxpr.debug_info, "func_name", "") or ""
  if (not name.startswith(PREFIX) or jaxpr.constvars or dumping()
      or set(kwargs) - {"outer_traceback"}):
    return None
  with np.printoptions(threshold=sys.maxsize):
    text = _plain(_printed(jaxpr))
  consts = _nested_consts(jaxpr)
  if consts is None:
    return None
  mesh = None
  if jax_mesh is not None and (jax_mesh.size != 1 or any(
      re.search(rf"\b{re.escape(str(axis))}\b", text) for axis in jax_mesh.axis_names)):
    mesh = jax_mesh
  devices = [(d.platform, getattr(d, "device_kind", ""), getattr(d, "compute_capability", ""))
             for d in configs.target_devices()]
  types = [[(tuple(a.shape), str(a.dtype)) for a in shapes] for shapes in (in_shapes, out_shapes)]
  # Switches the lowering may read besides: jax's Pallas and Mosaic settings, Mosaic GPU's
  # variables.
  switches = sorted((k, repr(v)) for k, v in jax.config.values.items()
                    if "pallas" in k or "mosaic" in k)
  switches += sorted((k, v) for k, v in os.environ.items() if k.startswith("MOSAIC_GPU"))
  parts = (text, repr(consts), repr(gpu_mesh), repr(mesh), repr(types), repr(params),
           repr(devices), repr(switches))
  return hashlib.sha256("\0".join(parts).encode()).digest()


def _printed(jaxpr) -> str:
  """`jaxpr` printed with each nested jaxpr in place, where it is used.

  NOTES: jax's printer (`Jaxpr.pretty_print`) pulls a nested jaxpr used more than once to the
  top and names it, by the object: inside a program, `jit`'s cache may hold two equal jaxprs
  of one function (`jnp.remainder` traced in two contexts of the kernel's body), which print as
  two definitions, where the kernel traced alone prints one; both lower to the same module.
  Printed in place, they are the same text. Where jax's printing internals are not as this
  expects, the public printer (the kernel is then lowered once more at worst)."""
  try:
    from jax._src import core
    _print_in_place()
    context = core.JaxprPpContext()
    settings = core.JaxprPpSettings(print_effects=True)
    _IN_PLACE.active = True
    try:
      return core.pp_jaxpr(jaxpr, context, settings).format()
    finally:
      _IN_PLACE.active = False
  except (AttributeError, TypeError):
    return jaxpr.pretty_print(source_info=False, print_effects=True)


# Set while this thread prints a key's jaxpr (`_printed`).
_IN_PLACE = threading.local()


def _print_in_place() -> None:
  """Makes jax's printer, while `_printed` prints on this thread (and only then), name each
  nested jaxpr's variables afresh where it is printed, so that one jaxpr object printed at two
  places prints as two equal jaxprs do. Printing there is jax's `pp_jaxpr`, which the
  printing of an equation's parameters calls by its module's name: hence the wrapper there.
  A nested jaxpr is closed (its values come in through its binders), so its names are its
  own."""
  from jax._src import core
  with _LOCK:
    original = core.pp_jaxpr
    if getattr(original, "__wrapped__", None) is not None:
      return

    def pp_jaxpr(jaxpr, context, settings):
      if not getattr(_IN_PLACE, "active", False):
        return original(jaxpr, context, settings)
      names = context.var_names
      context.var_names = collections.defaultdict(names.default_factory)
      try:
        return original(jaxpr, context, settings)
      finally:
        context.var_names = names

    pp_jaxpr.__wrapped__ = original
    core.pp_jaxpr = pp_jaxpr


def _nested_consts(jaxpr) -> list | None:
  """The constants of the jaxprs nested in `jaxpr`'s equations (a `jit` inside a kernel may
  close over arrays: the text names them, not their values), each as its type and a digest
  of its bytes (a value of the enclosing trace by its type alone); None where one is neither."""
  out = []
  for eqn in jaxpr.eqns:
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if not hasattr(sub, "eqns"):
          continue
        for const in getattr(sub, "consts", ()):
          if isinstance(const, jax.core.Tracer):
            # A value of the enclosing trace (a kernel's `run_scoped` refers to the kernel's
            # refs so), not a constant: the text names it where it is used.
            out.append(("traced", tuple(const.shape), str(const.dtype)))
            continue
          try:
            array = np.asarray(const)
          except Exception:  # noqa: BLE001 - not an array: this kernel is not kept
            return None
          out.append((array.shape, str(array.dtype),
                      hashlib.sha256(array.tobytes()).hexdigest()))
        inner = _nested_consts(getattr(sub, "jaxpr", sub))
        if inner is None:
          return None
        out.extend(inner)
  return out


# What a kernel's jaxpr prints inside a program and not alone, though its lowering is the
# same: the operands' varying mesh axes (`{V:...}`, shard_map's types) and a nested `jit`'s
# context mesh (`ctx_mesh=Mesh(...)`), with the line breaks the longer parameters bring; and
# each jaxpr's effects, a set printed in no fixed order.
_VARYING = re.compile(r"\{V:[^{}]*\}")
_CTX_MESH = re.compile(r"ctx_mesh=Mesh\((?:[^()]|\([^()]*\))*\)")
_SPACE = re.compile(r"\s+")
_AROUND = re.compile(r" ?([\[\](){},=:]) ?")
_EFFECTS = re.compile(r"(\bin\([^()]*\):\{)([^{}]*)(\})")


def _plain(text: str) -> str:
  """`text` (a printed jaxpr) without what only the context of its trace adds, its effects
  sorted."""
  text = _CTX_MESH.sub("", _VARYING.sub("", text))
  text = _AROUND.sub(r"\1", _SPACE.sub(" ", text))
  return _EFFECTS.sub(lambda m: m[1] + ",".join(sorted(m[2].split(","))) + m[3], text)


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


def lowerings() -> dict[str, int]:
  """How many of jax_ep's kernel modules this process has lowered (`lowered`) and read back
  from an earlier lowering (`read_back`)."""
  with _LOCK:
    return {"lowered": _STATE["lowered"], "read_back": _STATE["read_back"]}


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
