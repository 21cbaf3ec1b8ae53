"""Benchmark timing: device spans from profiler traces, host-clock medians, marginal periods.

Two ways to time an op (records say which in `timing`):
- `time_batches`: the median over `repeats` of one jitted batch of `calls` independent
  invocations on different input sets, divided by `calls`.
- `time_single_calls`: the median over `repeats` of one invocation per run, cycling through the
  input sets.
On a GPU a run's time is its device span read from a `jax.profiler` trace (first kernel start to
last kernel end), so host launch and synchronisation costs between runs stay out; elsewhere it
is the host clock around `block_until_ready`. Warm-up calls run first, so compilation and module
loading are excluded. The two ways differ where XLA's command buffers matter: a batch lets XLA
run independent fusions concurrently, and an executable too small for a command buffer (a single
call of a few kernels) pays a host launch gap between its kernels inside the span.
"""

from __future__ import annotations

import os
import statistics
import time

import jax

def time_batches(fn, args, *, repeats: int = 20, method: str = "auto",
                 before_each=None) -> tuple[float, str]:
  """Median seconds of one `fn(*args)` (which should itself run a batch), after one warm-up.

  Returns `(seconds, method)`. On a GPU the time is the device span of each run, read from a
  profiler trace (first kernel start to last kernel end of the run, excluding host launch and
  sync overhead): `method == "device_trace"`. Elsewhere, or if the trace has no device events,
  the host clock around `block_until_ready` (`"host_clock"`). `before_each(r)`, when given, runs
  before run r and outside its clock (host clock only): e.g. a barrier that releases the
  processes of a multi-process op together.
  """
  jax.block_until_ready(fn(*args))
  # Processes that run collective kernels together must all make the same number of calls, so
  # they pass method="host_clock" (a profiler failure in one process must not change its count).
  if method == "auto" and jax.devices()[0].platform == "gpu":
    try:
      spans = _device_spans(fn, args, repeats)
      if len(spans) >= max(3, repeats // 2):
        return statistics.median(spans), "device_trace"
    except Exception as e:  # noqa: BLE001 - any profiler problem falls back to the host clock
      print(f"device trace timing unavailable ({type(e).__name__}: {e}); using the host clock")
  return _host_clock_median(lambda _: fn(*args), repeats, before_each), "host_clock"



def _host_clock_median(run, repeats: int, before_each=None) -> float:
  """Median host-clock seconds of `run(r)` for r in range(repeats), each waited for, each after
  `before_each(r)` (not timed) when given."""
  samples = []
  for r in range(repeats):
    if before_each is not None:
      before_each(r)
    start = time.perf_counter()
    jax.block_until_ready(run(r))
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)



def _gpu_stream_events(fn, args, repeats: int) -> list[tuple[str, int, int]]:
  """Runs `fn(*args)` `repeats` times under a jax.profiler trace; its GPU stream events as
  `(name, start_ns, end_ns)`. Raises when the trace cannot be read (after the runs)."""
  return _traced_events(lambda _: fn(*args), repeats)



class TraceUnavailable(RuntimeError):
  """The profiler could not trace the runs, or its trace could not be read."""



def _traced_events(run, repeats: int, *, with_device: bool = False,
                   with_stream: bool = False, host: list | None = None) -> list[tuple]:
  """`run(r)` for r in range(repeats), each waited for, under a jax.profiler trace; the GPU
  stream events as `(name, start_ns, end_ns)`, with the device's plane name appended when
  `with_device`, then the stream's line name ("Stream #N...") when `with_stream`. The runs
  happen whether or not the trace could start (processes that run collective kernels together
  must all make the same calls); after them, TraceUnavailable says the trace could not be had.
  An error raised by a run propagates as itself. `host`, a list: the host's events (XLA's
  thunks, the CUDA API calls) are appended to it as `(name, start_ns, end_ns, line name)`, on
  the device events' clock."""
  import glob
  import tempfile
  from jax._src.lib import _profile_data

  with tempfile.TemporaryDirectory() as trace_dir:
    try:
      jax.profiler.start_trace(trace_dir)
      start_error = None
    except Exception as e:  # noqa: BLE001 - reported after the runs
      start_error = e
    try:
      for r in range(repeats):
        jax.block_until_ready(run(r))
    finally:
      if start_error is None:
        jax.profiler.stop_trace()
    if start_error is not None:
      raise TraceUnavailable(f"the profiler did not start: {start_error}") from start_error
    try:
      (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
      profile = _profile_data.ProfileData.from_file(path)
    except Exception as e:  # noqa: BLE001 - any unreadable trace
      raise TraceUnavailable(f"the trace could not be read: {e}") from e
    events = []
    for plane in profile.planes:
      if host is not None and plane.name.startswith("/host:"):
        for line in plane.lines:
          host += [(ev.name, ev.start_ns, ev.start_ns + ev.duration_ns, line.name)
                   for ev in line.events]
      if not plane.name.startswith("/device:GPU"):
        continue
      for line in plane.lines:
        if line.name.startswith("Stream"):
          events += [(ev.name, ev.start_ns, ev.start_ns + ev.duration_ns)
                     + ((plane.name,) if with_device else ())
                     + ((line.name,) if with_stream else ()) for ev in line.events]
  return events



def time_single_calls(fn, arg_sets, *, repeats: int = 24, method: str = "auto",
                      skip_leading_kernels: int = 0) -> tuple[float, str]:
  """Median seconds of one `fn(*arg_sets[r % len(arg_sets)])`, one call per run.

  Each run is one op in its own executable, waited for before the next: the op's latency as a
  dependent layer stack sees it (nothing to overlap it with; batches of independent calls let
  XLA run independent fusions concurrently, which no model with one op per layer gets). Cycling
  through the sets keeps the inputs out of the L2 when they add up to more than it holds. On a
  GPU the time is each run's device span from a profiler trace (`"device_trace_single"`),
  elsewhere, or with `method="host_clock"` (processes that run collective kernels together must
  make the same number of calls), the host clock. `skip_leading_kernels` (device trace only):
  each run's span starts after its first kernels, which produce the op's inputs (split_runs);
  the kernel names of the first traced run are printed, to check which ones those were.
  """
  for args in arg_sets:
    jax.block_until_ready(fn(*args))
  run = lambda r: fn(*arg_sets[r % len(arg_sets)])
  if method == "auto" and jax.devices()[0].platform == "gpu":
    try:
      events = _traced_events(run, repeats)
      if skip_leading_kernels and events:
        first = sorted(events, key=lambda e: e[1])
        print("  first traced run begins with: "
              + ", ".join(name[:40] for name, _, _ in first[:skip_leading_kernels + 3]))
      spans = split_runs([(start, end, name) for name, start, end in events], repeats,
                         skip_leading=skip_leading_kernels)
      if len(spans) >= max(3, repeats // 2):
        return statistics.median(spans), "device_trace_single"
    except Exception as e:  # noqa: BLE001 - any profiler problem falls back to the host clock
      print(f"device trace timing unavailable ({type(e).__name__}: {e}); using the host clock")
  return _host_clock_median(run, repeats), "host_clock"



def _device_spans(fn, args, repeats: int) -> list[float]:
  """Per run: seconds from its first device event to its last, from a jax.profiler trace.

  Runs are told apart by the `repeats - 1` largest idle gaps on the device: each run waits on the
  host for the previous one to finish, so the gap between runs holds a whole host round trip,
  while the kernels inside one run (one executable) are queued back to back.
  """
  events = _gpu_stream_events(fn, args, repeats)
  return split_runs([(start, end) for _, start, end in events], repeats)



def kernel_breakdown(fn, args, *, repeats: int = 5) -> list[tuple[str, float, int]]:
  """Per kernel name: (name, mean device microseconds per run, launches per run), longest first.

  Every process of a multi-process benchmark must call this the same number of times (it runs
  `fn` `repeats` times whatever happens); it returns [] when the trace cannot be read.
  """
  return trace_breakdown(fn, args, repeats=repeats)[0]



def trace_breakdown(fn, args, *, repeats: int = 5):
  """`(kernel_breakdown's rows, activity)`, from one trace. `activity`: per GPU plane of the
  trace, `(plane name, busy µs per run, span µs per run)`: how long some kernel ran on the
  device (overlapping kernels counted once) against the run's first-start-to-last-end span. A
  span well past the busy time means the device sat idle inside the run (host-side waits,
  launch gaps); spin-waiting kernels count as busy.
  """
  try:
    events = _traced_events(lambda _: fn(*args), repeats, with_device=True)
  except TraceUnavailable:  # a diagnostic only
    return [], []
  totals: dict[str, list[int]] = {}
  for name, start, end, _ in events:
    totals.setdefault(name, []).append(end - start)
  rows = [(name, sum(d) / repeats / 1e3, len(d) // repeats) for name, d in totals.items()]
  activity = []
  for plane in sorted({e[3] for e in events}):
    intervals = sorted((start, end) for _, start, end, p in events if p == plane)
    busy, covered_until = 0, None
    for start, end in intervals:
      if covered_until is None or start >= covered_until:
        busy += end - start
        covered_until = end
      elif end > covered_until:
        busy += end - covered_until
        covered_until = end
    # Mean, not median: a spinning kernel that straddles two runs moves split_runs' cuts, which
    # can leave one long segment and several short ones; their sum still excludes the idle
    # time between runs.
    spans = split_runs(intervals, repeats)
    span_us = sum(spans) / repeats * 1e6 if spans else float("nan")
    activity.append((plane, busy / repeats / 1e3, span_us))
  return sorted(rows, key=lambda r: -r[1]), activity



def steady_call_period_us(fn, args, *, calls_per_run: int, marker: str | tuple[str, ...],
                          repeats: int = 5) -> float | None:
  """The device clock's period of back-to-back calls inside one program, in µs: `fn(*args)` runs
  `calls_per_run` calls of an op whose kernels include one named with `marker` once per call
  (a tuple: a name holding each of its substrings, in the trace's spelling, mangled or not).
  Per GPU plane of a trace, each run's (last marker end - first marker end) / (calls_per_run -
  1); the median over runs, the largest over planes. The first call of a run also waits out the
  start skew of the processes (or of the host), which this leaves out; every later call still
  waits for its peers, so a rank paced by a slower one shows the slower pace. Planes without the
  marker are left out. None when the trace cannot be had, or a plane has the marker other than
  once per call, or none has it. The runs happen in any case (see _traced_events).
  """
  if calls_per_run < 2:
    raise ValueError(f"calls_per_run must be at least 2, got {calls_per_run}")
  try:
    events = _traced_events(lambda _: fn(*args), repeats, with_device=True)
  except TraceUnavailable:
    return None
  return _steady_period_us(events, calls_per_run, marker, repeats)



def _steady_period_us(events, calls_per_run: int, marker: str | tuple[str, ...],
                      repeats: int) -> float | None:
  """steady_call_period_us on `(name, start_ns, end_ns, plane)` events."""
  parts = (marker,) if isinstance(marker, str) else tuple(marker)
  periods = []
  for plane in sorted({e[3] for e in events}):
    ends = sorted(end for name, _, end, p in events if p == plane and all(m in name for m in parts))
    if not ends:
      continue  # a plane without the op (e.g. another GPU's copies seen by this process)
    if len(ends) != calls_per_run * repeats:
      return None
    runs = [ends[i:i + calls_per_run] for i in range(0, len(ends), calls_per_run)]
    periods.append(statistics.median((run[-1] - run[0]) / (calls_per_run - 1) / 1e3
                                     for run in runs))
  return max(periods) if periods else None



def split_runs(events, num_runs: int, skip_leading: int = 0) -> list[float]:
  """Seconds spanned by each of `num_runs` runs in device events: `(start_ns, end_ns)` tuples,
  or `(start_ns, end_ns, name)`.

  `skip_leading`: each run's span leaves out its first `skip_leading` kernels, which produce the
  op's inputs and are not the op's time: it starts at the next event, or when they have all
  ended if that event started earlier. (XLA may start a kernel a little before the one it
  depends on has ended, programmatic dependent launch: its prologue overlaps, and it waits on the
  device. On the H200 the reference's combine started up to ~0.1 us before the rewrite ended in
  about half of the runs; keeping only events that start after it left too few runs to time.)
  Named events that are memory operations ("Memset ...", "Memcpy...") and come before them are
  left out too and not counted. Runs with no event left are left out.
  """
  spans = []
  for events_of_run in group_runs(events, num_runs):
    run, begin = _after_leading_kernels(events_of_run, skip_leading)
    if run:
      spans.append((max(e[1] for e in run) - max(run[0][0], begin)) * 1e-9)
  return spans


def group_runs(events, num_runs: int) -> list[list]:
  """`events` (tuples starting `(start_ns, end_ns, ...)`) sorted and cut into `num_runs` runs
  at the `num_runs - 1` largest idle gaps of the device (each run waits on the host for the
  previous one, so a whole host round trip lies between runs); [] with fewer events than runs.
  """
  if len(events) < num_runs:
    return []
  events = sorted(events)
  gaps, busy_until = [], events[0][1]
  for i in range(1, len(events)):
    gaps.append((events[i][0] - busy_until, i))
    busy_until = max(busy_until, events[i][1])
  cuts = sorted(i for _, i in sorted(gaps, reverse=True)[:num_runs - 1])
  return [events[lo:hi] for lo, hi in zip([0] + cuts, cuts + [len(events)])]



def _after_leading_kernels(run, count: int):
  """`(events, begin)`: the events of `run` (sorted by start) after its first `count` kernels,
  and when those kernels had all ended (see split_runs; the run's start when `count` is 0)."""
  if count == 0:
    return run, run[0][0]
  skipped, skipped_end = 0, None
  for i, event in enumerate(run):
    name = event[2] if len(event) > 2 else ""
    if name.startswith(("Memset", "Memcpy")):
      continue
    skipped += 1
    skipped_end = event[1] if skipped_end is None else max(skipped_end, event[1])
    if skipped == count:
      return run[i + 1:], skipped_end
  return [], None


def device_run_spans(run, repeats: int) -> list[float]:
  """Seconds of device time spanned by each of `run(r)` for r in range(repeats) (a profiler
  trace, runs told apart as in split_runs). The runs happen whatever the profiler does; raises
  TraceUnavailable after them when it could not trace."""
  events = _traced_events(run, repeats)
  return split_runs([(start, end) for _, start, end in events], repeats)
