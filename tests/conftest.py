"""Test set-up: 8 host devices on the CPU, and `jax.distributed` when started by jax_ep.launch.

Also: the `ranks` marker generates only the rank counts this run can build; GPU-only tests are
skipped where there is no GPU.
"""

import os

# Must happen before jax is imported anywhere: 8 host devices stand in for 8 EP ranks on the CPU.
# Under jax_ep.launch each process is one rank with its own device instead.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags and "JAX_EP_PROCESS_ID" not in os.environ:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from jax_ep import launch  # noqa: E402

launch.initialize_from_env()


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc):
  """`@pytest.mark.ranks(argnames, values, count=...)`: `parametrize(argnames, values)` with only
  the values whose rank count this process can run (the class's `rank_counts`, when it has
  them, and enough devices in the job; see `ep_test_base.rank_count_runs`). The rank count of a
  value is its first element, or `count(*value)`. A test left with none is one skipped item
  that says why."""
  marker = metafunc.definition.get_closest_marker("ranks")
  if marker is None:
    return
  from ep_test_base import rank_count_runs
  argnames, values = marker.args
  count = marker.kwargs.get("count", lambda first, *rest: first)
  names = [n.strip() for n in argnames.split(",")]
  allowed = getattr(metafunc.cls, "rank_counts", None)

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
  from jax_ep._native import ffi as _ffi
  if _ffi.cuda_available():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU and the jax_ep CUDA extension")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
