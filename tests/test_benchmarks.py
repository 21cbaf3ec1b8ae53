"""The benchmark scripts keep working (tiny sizes on the CPU) and their timing helpers are right."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bounds  # noqa: E402
import numpy as np  # noqa: E402
import reports  # noqa: E402
import timers  # noqa: E402

REQUIRED_KEYS = {"op", "mode", "backend", "ranks", "process_model", "tokens_per_rank", "hidden",
                 "topk", "experts", "dtype", "wire_dtype", "median_us", "bytes", "gbps",
                 "min_hbm_bytes", "bound_gbps", "bound", "roofline", "gpu", "jax", "date",
                 "commit"}


def test_split_runs_cuts_at_the_largest_gaps():
  events = [(0, 10), (12, 20), (21, 30), (100, 110), (111, 125), (300, 305), (306, 340)]
  spans = timers.split_runs(events, 3)
  assert [round(s * 1e9) for s in spans] == [30, 25, 40]


def test_split_runs_can_start_each_span_after_its_leading_events():
  # The first event of each run produces the op's inputs (bench_local's fresh-rows timing).
  events = [(0, 10), (12, 20), (21, 30), (100, 110), (111, 125), (300, 305)]
  spans = timers.split_runs(events, 3, skip_leading=1)
  assert [round(s * 1e9) for s in spans] == [18, 14]  # the third run had nothing left


def test_split_runs_skips_leading_memory_operations_and_starts_after_the_skipped_kernel():
  # Run 1: a memset, then the rewrite (10-40), then the op (45-60): the span starts at the op.
  # Run 2: the rewrite (200-230), then the op, launched before the rewrite ended (228-250, as
  # XLA's programmatic dependent launch does): the span starts when the rewrite ended.
  # Run 3: the rewrite alone: nothing left, so the run is left out.
  events = [(0, 5, "Memset 3"), (10, 40, "rewrite"), (45, 60, "op"),
            (200, 230, "rewrite"), (228, 250, "op"), (400, 430, "rewrite")]
  assert [round(s * 1e9) for s in timers.split_runs(events, 3, skip_leading=1)] == [15, 20]


def test_split_runs_handles_overlapping_streams():
  # Two streams overlap inside a run; the gap is measured from the latest end seen so far.
  events = [(0, 50), (10, 20), (60, 70), (200, 210)]
  assert [round(s * 1e9) for s in timers.split_runs(events, 2)] == [70, 10]


def test_trace_breakdown_counts_overlapping_kernels_once_per_device(monkeypatch):
  # Two runs per device; on GPU:0 kernels a and b overlap (busy 0-20), then c (30-40).
  gpu0 = [("a", 0, 10), ("b", 5, 20), ("c", 30, 40)]
  gpu1 = [("a", 0, 40)]
  events = [(n, s + r * 1000, e + r * 1000, plane) for r in range(2)
            for plane, run in (("/device:GPU:0", gpu0), ("/device:GPU:1", gpu1))
            for n, s, e in run]
  monkeypatch.setattr(timers, "_traced_events", lambda run, repeats, with_device: events)
  rows, activity = timers.trace_breakdown(None, (), repeats=2)
  assert rows == [("a", 0.05, 2), ("b", 0.015, 1), ("c", 0.01, 1)]
  assert [(p, round(b * 1e3), round(s * 1e3)) for p, b, s in activity] == [
      ("/device:GPU:0", 30, 40), ("/device:GPU:1", 40, 40)]


def test_steady_period_skips_the_first_calls_wait_and_takes_the_slowest_device():
  # Two runs of three calls per device; each call ends with a "Finish" kernel. On GPU:0 the first
  # call waited 500 ns (skew), then calls end 100 ns apart; on GPU:1 they end 120 ns apart.
  def run(plane, first_end, period, offset):
    return [(name, offset + first_end + c * period - 5, offset + first_end + c * period, plane)
            for c in range(3) for name in ("Send", "FinishKernel")]
  events = (run("/device:GPU:0", 500, 100, 0) + run("/device:GPU:0", 500, 100, 10_000)
            + run("/device:GPU:1", 480, 120, 0) + run("/device:GPU:1", 480, 120, 10_000))
  assert timers._steady_period_us(events, 3, "FinishKernel", 2) == 0.12
  # A plane without the op (another GPU's copies seen by this process) is left out.
  assert timers._steady_period_us(events + [("Memcpy", 0, 50, "/device:GPU:2")], 3,
                                  "FinishKernel", 2) == 0.12
  # A marker that is on a plane other than once per call, or on none, gives no period.
  assert timers._steady_period_us(events[:-2], 3, "FinishKernel", 2) is None
  assert timers._steady_period_us(events, 3, "Absent", 2) is None


def test_steady_period_marker_of_several_parts_matches_names_holding_each():
  # Across hosts a call runs the host groups' FinishKernel once per source host and the rail
  # exchange's once: the marker ("rail", "FinishKernel") counts the latter only.
  events = [(name, c * 100 + off, c * 100 + off + 1, "/device:GPU:0") for r in range(2)
            for c in range(r * 10, r * 10 + 3)
            for name, off in (("peer::FinishKernel", 10), ("peer::FinishKernel", 20),
                              ("jax_ep::rail::(anonymous namespace)::FinishKernel", 50))]
  assert timers._steady_period_us(events, 3, ("rail", "FinishKernel"), 2) == 0.1
  assert timers._steady_period_us(events, 3, "FinishKernel", 2) is None


def test_high_throughput_paths_follow_the_rail_then_the_host():
  from jax_ep.backends import topology
  # 4 ranks on 2 hosts {0, 1} {2, 3}, one token each, top-2 (destination ranks; -1: none).
  dest = np.array([[[1, 3]], [[2, 3]], [[2, -1]], [[0, 1]]])
  network, peer = reports.high_throughput_paths(dest, topology.discover(["a"] * 4,
                                                                        virtual_hosts=2))
  # Rank 0's token: to 1 by the peer path; to host 1 by the network to rank 2 (local index 0),
  # which forwards it to 3. Rank 1's: to rank 3 by the network, forwarded to 2. Rank 2's stays
  # home. Rank 3's: to rank 1 (local index 1) by the network, forwarded to 0.
  assert (network, peer) == (3 / 4, 4 / 4)
  # One host: every row from another rank takes the peer path; one rank per host: the network.
  assert reports.high_throughput_paths(dest, None) == (0.0, 6 / 4)
  assert reports.high_throughput_paths(dest, topology.discover(["a"] * 4, virtual_hosts=4)) == (
      6 / 4, 0.0)


def test_time_single_calls_cycles_through_the_input_sets():
  seen = []
  fn = lambda a: seen.append(int(a)) or a
  seconds, method = timers.time_single_calls(fn, [(0,), (1,), (2,)], repeats=5,
                                             method="host_clock")
  assert method == "host_clock" and seconds >= 0
  assert seen == [0, 1, 2] + [0, 1, 2, 0, 1]  # one warm-up call per set, then the timed runs


def _xla_flags(devices):
  """XLA_FLAGS for a benchmark on `devices` CPU devices, keeping this run's other XLA flags
  (tests/conftest.py's compile settings)."""
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join(kept + [f"--xla_force_host_platform_device_count={devices}"])


def test_bench_local_runs_and_writes_contract_records(tmp_path):
  out = tmp_path / "local.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_local.py"), "--backends",
       "reference", "xla_baseline", "--tokens", "8", "--hidden", "128", "--calls", "2",
       "--timing", "single", "batch", "fresh", "--out", str(out)],
      env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert {(r["op"], r["backend"], r["calls_per_run"]) for r in records} == {
      (op, backend, per_run) for op in ("dispatch", "combine")
      for backend in ("reference", "xla_baseline") for per_run in (1, 2)}
  # Fresh-rows timing needs a GPU trace: on the CPU it runs once and says why it wrote nothing.
  for backend in ("reference", "xla_baseline"):
    assert f"T=8 combine {backend}: no fresh-rows timing" in result.stdout
  for r in records:
    assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
    assert r["min_hbm_bytes"] == (8 + 8 * 8) * 128 * 2


def _run_bench_intranode_on_cpu(*args):
  """bench_intranode.py on 4 CPU devices in one process (the reference backend's collectives)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=_xla_flags(devices=4))
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_intranode.py"), "--backends",
       "reference", "--tokens", "16", "--hidden", "128", *args],
      env=env, capture_output=True, text=True, timeout=300)


def test_bench_intranode_runs_on_the_reference_backend(tmp_path):
  out = tmp_path / "intranode.jsonl"
  result = _run_bench_intranode_on_cpu("--experts", "16", "--topk", "2", "--calls", "2",
                                       "--repeats", "3", "--aligned-single", "--out", str(out))
  assert result.returncode == 0, result.stdout + result.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()]
  kinds = {(r["op"], r["timing"], r["calls_per_run"]) for r in records}
  assert {k for k in kinds if k[1] != "host_clock_marginal"} == {
      (op, timing, per_run) for op in ("dispatch", "combine")
      for timing, per_run in (("host_clock", 2), ("host_clock_aligned", 1))}
  # The marginal record (a batch of 4 calls less a batch of 2, per call) is written only when
  # the longer batch was slower, which CPU timing noise does not always allow; when it is
  # left out, the run says so.
  for op in ("dispatch", "combine"):
    marginal = [r for r in records if r["op"] == op and r["timing"] == "host_clock_marginal"]
    if marginal:
      assert len(marginal) == 1 and marginal[0]["calls_per_run"] == 2
      assert marginal[0]["median_us"] > 0
    else:
      assert f"reference {op}: no host_clock_marginal record" in result.stdout
  for r in records:
    assert REQUIRED_KEYS <= set(r) and r["ranks"] == 4


def test_bench_intranode_remote_routing_sends_every_row_to_a_peer(tmp_path):
  out = tmp_path / "intranode.jsonl"
  result = _run_bench_intranode_on_cpu("--experts", "16", "--topk", "2", "--calls", "2",
                                       "--repeats", "2", "--no-marginal", "--routing", "remote",
                                       "--out", str(out))
  assert result.returncode == 0, result.stdout + result.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert {(r["op"], r["timing"]) for r in records} == {
      ("dispatch", "host_clock"), ("combine", "host_clock")}
  for r in records:
    # No token picks an expert of its own rank, so every received row crossed from a peer.
    assert r["routing"] == "remote" and r["nvlink_bytes"] == r["bytes"] > 0
    # One host: all of them by the peer path (to within the mean's rounding), none by the network.
    assert r["hosts"] == 1 and r["network_bytes"] == 0
    assert abs(r["peer_bytes"] - r["bytes"]) < 128 * 2


def test_bench_intranode_times_each_wire_format_in_one_run(tmp_path):
  """--wire-format plain fp8_ue8m0: the dispatch of both formats on the same inputs in one run
  (their ratio pairs within the run), each record naming its wire_dtype and counting its row's
  bytes; the combine, unchanged by the format, with plain only."""
  out = tmp_path / "intranode.jsonl"
  result = _run_bench_intranode_on_cpu("--experts", "16", "--topk", "2", "--calls", "2",
                                       "--repeats", "2", "--no-marginal", "--hidden", "512",
                                       "--wire-format", "plain", "fp8_ue8m0",
                                       "--fp8-quantized-by", "dispatch", "caller",
                                       "--out", str(out))
  assert result.returncode == 0, result.stdout + result.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert sorted((r["op"], r["wire_format"], r["wire_dtype"], r.get("fp8_quantized_by", ""))
                for r in records) == [
      ("combine", "plain", "bfloat16", ""),
      ("dispatch", "fp8_ue8m0", "float8_e4m3fn", "caller"),
      ("dispatch", "fp8_ue8m0", "float8_e4m3fn", "dispatch"),
      ("dispatch", "plain", "bfloat16", "")]
  by_format = {(r["wire_format"], r.get("fp8_quantized_by")): r for r in records
               if r["op"] == "dispatch"}
  plain, fp8 = by_format["plain", None], by_format["fp8_ue8m0", "dispatch"]
  assert by_format["fp8_ue8m0", "caller"]["bytes"] == fp8["bytes"]
  # Rows of 512 bf16 values against 512 e4m3 bytes and 4 exponent bytes, per received row.
  assert plain["bytes"] * (512 + 4) == fp8["bytes"] * 512 * 2
  for r in records:
    assert REQUIRED_KEYS <= set(r)


def test_bench_intranode_remote_routing_rejects_topk_past_the_other_ranks_experts(tmp_path):
  result = _run_bench_intranode_on_cpu("--experts", "8", "--topk", "7", "--routing", "remote",
                                       "--out", str(tmp_path / "unused.jsonl"))
  assert result.returncode != 0
  assert "--topk <= 6" in result.stdout + result.stderr


def test_bench_p2p_says_what_it_needs_where_it_cannot_run():
  # CI machines have neither CuPy nor GPUs; the script must say so, not fail with a traceback.
  try:
    import cupy  # noqa: F401
    pytest.skip("CuPy is installed: the GPU round runs bench_p2p.py itself")
  except ImportError:
    pass
  result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_p2p.py")],
                          capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "needs CuPy and two GPUs" in result.stderr and "Traceback" not in result.stderr


def test_traced_events_runs_every_time_when_the_profiler_cannot_start(monkeypatch):
  # Processes that run collective kernels together must make the same calls whatever the
  # profiler does; the failure is reported after the runs.
  def fail(_):
    raise RuntimeError("profiler busy")
  monkeypatch.setattr(timers.jax.profiler, "start_trace", fail)
  runs = []
  with pytest.raises(timers.TraceUnavailable, match="profiler busy"):
    timers._traced_events(lambda r: runs.append(r) or r, 3)
  assert runs == [0, 1, 2]
  assert timers.steady_call_period_us(lambda: 0, (), calls_per_run=2, marker="M",
                                      repeats=2) is None


@pytest.mark.parametrize("value, narrowed", [(None, False), ("0", True), (" 3 ,", True),
                                             ("0,1", False), ("", False)])
def test_narrowed_to_one_gpu_reads_cuda_visible_devices(monkeypatch, value, narrowed):
  if value is None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  else:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
  assert bounds.narrowed_to_one_gpu() is narrowed


def test_a_program_is_sized_by_xlas_plan_before_it_is_timed():
  """bench_layers and bench_intranode check a program against the process's share of the GPU
  before timing it (processes sharing one GPU would otherwise run out of its memory one by
  one): XLA's plan of the program's bytes holds its argument and its output; a program that
  does not compile has none; a device that reports no allocator limit has no share, and off
  GPUs every program fits."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((256, 128), jnp.float32)
  program = jax.jit(lambda a: (a @ a.T).sum(0))
  need = reports.program_bytes(program, (x,))
  assert need is not None and need >= x.nbytes + 256 * 4
  assert reports.program_bytes(jax.jit(lambda a: a @ a), (jnp.ones((3, 4)),)) is None
  if jax.devices()[0].platform == "cpu":
    assert reports.gpu_share_bytes(8) is None
    assert reports.fits_gpu(program, (x,), "test/fits", "a program", sharing=8)


@pytest.mark.parametrize("num_devices", [1, 4])
def test_bench_layers_writes_layer_chain_records(tmp_path, num_devices):
  out = tmp_path / "layers.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=_xla_flags(devices=num_devices))
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_layers.py"), "--tokens", "16",
       "--hidden", "128", "--experts", "16", "--topk", "2", "--ffn", "64", "--layers", "2",
       "--repeats", "3", "--expert", "identity", "swiglu", "--virtual-hosts", "1", "2",
       "--out", str(out)],
      env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  # No GPU here: the cuda rows say why they are missing, and so does plain XLA across ranks.
  assert "cuda: unavailable here (backend='auto' picked reference" in result.stdout
  assert "cuda (virtual_hosts=2): unavailable here: jax_ep.Group: " in result.stdout
  records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
  backends = {"reference"} | ({"xla_baseline"} if num_devices == 1 else set())
  # A marginal record is left out where CPU timing noise made t(2N) <= t(N); it says so.
  for backend in backends:
    for expert in ("identity", "swiglu"):
      mine = [r for r in records if (r["backend"], r["expert"]) == (backend, expert)]
      assert mine or f"{backend} {expert}: no host_clock_marginal record" in result.stdout
  for r in records:
    assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
    assert r["op"] == "layer_chain" and r["layers"] == 2 and r["ranks"] == num_devices
    assert r["settings"] == "default" and r["raise_on_timeout"] is False
    assert r["micro_batches"] == 1
    assert r["capacity"] == num_devices * 16 * min(2, 16 // num_devices)
    assert r["timing"] == "host_clock_marginal" and r["median_us"] > 0
    # One host: nothing took the network path.
    assert (r["hosts"], r["gpus_per_host"], r["network_bytes"]) == (1, [num_devices], 0)
    assert 0 <= r["peer_bytes"] <= r["bytes"]


def test_bench_layers_micro_batches_field(tmp_path):
  """`--micro-batches 1 2`: every record says its count, and the split chain runs forward and
  forward + backward beside the unsplit one (a record each, or the noise message naming it)."""
  out = tmp_path / "layers.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(devices=2))
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_layers.py"), "--tokens", "16",
       "--hidden", "128", "--experts", "16", "--topk", "2", "--ffn", "64", "--layers", "2",
       "--repeats", "3", "--expert", "swiglu", "--backends", "reference", "--passes",
       "forward", "forward_backward", "--micro-batches", "1", "2", "--out", str(out)],
      env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
  for r in records:
    assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
    assert r["op"] == "layer_chain" and r["micro_batches"] in (1, 2) and r["ranks"] == 2
    # The group is sized for one micro-batch: its default capacity per call, 16 / n tokens'.
    assert r["capacity"] == 2 * (16 // r["micro_batches"]) * 2
  for pass_ in ("forward", "forward_backward"):
    for micro_batches in (1, 2):
      mine = [r for r in records if (r["pass"], r["micro_batches"]) == (pass_, micro_batches)]
      split = f" micro_batches={micro_batches}" if micro_batches != 1 else ""
      assert mine or f"reference swiglu{split}: no host_clock_marginal" in result.stdout
  bad = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_layers.py"), "--tokens", "16",
       "--micro-batches", "3"], env=env, capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0
  assert "--micro-batches must be positive and divide --tokens=16, got [3]" in bad.stderr


def test_bench_layers_fp8_wire_beside_bf16_rows(tmp_path):
  """`--wire-formats plain fp8`: each group again with an fp8 wire (dispatch sends e4m3 rows
  with their scales, the identity expert dequantises them for combine), forward and forward +
  backward, its records saying so and counting the e4m3 rows' bytes."""
  out = tmp_path / "layers.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(devices=2))
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_layers.py"), "--tokens", "16",
       "--hidden", "256", "--experts", "16", "--topk", "2", "--layers", "2", "--repeats", "3",
       "--backends", "reference", "--passes", "forward", "forward_backward",
       "--wire-formats", "plain", "fp8", "--out", str(out)],
      env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "failed" not in result.stdout, result.stdout
  records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
  by_wire = {}
  for r in records:
    assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
    by_wire.setdefault(r["wire_format"], []).append(r)
    fp8 = r["wire_format"] == "fp8"
    assert r["wire_dtype"] == ("float8_e4m3fn" if fp8 else "bfloat16")
    assert r["settings"] == ("wire_format=fp8" if fp8 else "default")
  for pass_ in ("forward", "forward_backward"):
    for wire in ("plain", "fp8"):
      assert ([r for r in by_wire.get(wire, []) if r["pass"] == pass_]
              or "no host_clock_marginal" in result.stdout), (pass_, wire, result.stdout)
  if by_wire.get("plain") and by_wire.get("fp8"):
    # A received row: 2H bytes of bf16, or H of e4m3 and a float32 scale per 128 channels;
    # combine sends 2H back either way.
    plain, fp8 = by_wire["plain"][0]["bytes"], by_wire["fp8"][0]["bytes"]
    assert fp8 / plain == pytest.approx((256 + 2 * 4 + 2 * 256) / (4 * 256), rel=1e-3)


@pytest.mark.slow
def _run_bench_layer_on_cpu(tmp_path, *args):
  """bench_layer.py on one CPU device, two repeats: `(its output, its records)`; it must
  exit 0."""
  out = tmp_path / "layer.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(devices=1))
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_layer.py"), "--repeats", "2",
       "--out", str(out), *args], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  return result.stdout, [json.loads(line) for line in out.read_text().splitlines()]


def test_bench_layer_writes_grouped_matmul_and_layer_records(tmp_path):
  stdout, records = _run_bench_layer_on_cpu(
      tmp_path, "--shapes", "qwen3_30b_a3b", "mixtral", "--scale", "32", "--tokens", "128")
  assert "no Mosaic GPU run (the Mosaic GPU kernel needs Hopper GPUs" in stdout
  assert {(r["op"], r["pass"], r["shape"]) for r in records} == {
      (op, p, s) for op in ("grouped_matmul", "moe_layer") for p in ("fwd", "fwd_bwd")
      for s in ("qwen3_30b_a3b", "mixtral")}
  for r in records:
    assert r["impl"] == "xla" and r["median_us"] > 0 and r["fraction"] > 0
    assert r.get("micro_batches", 1) == 1
    assert {"tflops", "bound_tflops", "experts", "hidden", "ffn", "tokens_per_rank",
            "ranks", "gpu", "jax", "date", "commit"} <= set(r)


def test_bench_layer_moe_layer_records_carry_micro_batches(tmp_path):
  stdout, records = _run_bench_layer_on_cpu(
      tmp_path, "--shapes", "mixtral", "--scale", "32", "--tokens", "128", "--ops", "moe_layer",
      "--micro-batches", "1", "2", "--breakdown", "3")
  # No device trace on the CPU: each pass says so after its timing.
  assert stdout.count("kernels by device time per run") == 4, stdout
  assert {(r["op"], r["pass"], r["micro_batches"]) for r in records} == {
      ("moe_layer", p, m) for p in ("fwd", "fwd_bwd") for m in (1, 2)}
  assert all(r["median_us"] > 0 for r in records)
  # Which expert kernels the layer took, and why not the fused ones (here: XLA's, asked for).
  assert all(r["fused_mlp"] is False and "ragged_dot" in r["kernels"] for r in records), records


def test_bench_layer_times_calls_per_step_with_the_weights_quantised_once(tmp_path):
  """Per call of two in one program, the FP8 weights quantised once; the FP8 layer with its
  weight gradients in FP8 and in bf16, each record saying which."""
  stdout, records = _run_bench_layer_on_cpu(
      tmp_path, "--shapes", "mixtral", "--scale", "16", "--tokens", "256", "--ops", "moe_layer",
      "--precisions", "bf16", "fp8", "--calls-per-step", "2", "--fp8-weight-grads", "fp8",
      "bf16")
  assert ": failed: " not in stdout, stdout
  assert sorted((r["pass"], r["precision"], r["calls_per_step"], r.get("weight_grad"))
                for r in records) == sorted(
      [(p, "bf16", 2, None) for p in ("fwd", "fwd_bwd")]
      + [(p, "fp8", 2, w) for p in ("fwd", "fwd_bwd") for w in ("fp8", "bf16")])
  assert all(r["median_us"] > 0 for r in records)


def test_bench_layer_times_each_weight_grad_tiles_in_one_run(tmp_path):
  """`--weight-grad-tiles`: every op once per set of tiles, side by side in one run; records
  of tiles other than the default name them."""
  runs = "128,128,64,2,4,1,2,16"
  _, records = _run_bench_layer_on_cpu(
      tmp_path, "--shapes", "mixtral", "--scale", "32", "--tokens", "128", "--ops",
      "grouped_matmul", "--weight-grad-tiles", "default", runs)
  assert sorted((r["pass"], r.get("weight_grad_tiles", "")) for r in records) == sorted(
      (p, t) for p in ("fwd", "fwd_bwd") for t in ("", runs))
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import bench_layer
  assert bench_layer.parse_tiles(runs).groups_per_run == 16
  assert bench_layer.parse_tiles("default") is None
  with pytest.raises(SystemExit, match="not 'default' or up to 8 comma-separated integers"):
    bench_layer.parse_tiles("128,x")


def test_bench_layer_breakdown_lists_the_longest_kernels(capsys):
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import bench_layer
  rows = [("fp8_gmm", 1200.0, 2), ("wgrad", 900.0, 3), ("quantize", 300.0, 6), ("copy", 5.0, 1)]
  bench_layer.print_breakdown("fwd", 2.5e-3, rows, [("/device:GPU:0", 2405.0, 2500.0)], 2)
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "--- fwd: 2500 µs (median); kernels by device time per run"
  assert out[1].split()[:4] == ["1200.0", "µs", "48.0", "%"] and out[1].endswith("fp8_gmm")
  assert "x3" in out[2] and out[2].endswith("wgrad")
  assert out[3].split()[:4] == ["305.0", "µs", "in", "2"]
  assert out[4] == "  /device:GPU:0: busy 2405 µs of a 2500 µs span per run"


def test_bench_expert_mlp_writes_expert_mlp_records(tmp_path):
  """No GPU here: the fused kernels say why they do not run, the unfused path gives the
  records, with the exact buffer and the padded ones at 2 and 8 times the rows."""
  out = tmp_path / "expert_mlp.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=_xla_flags(devices=1))
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_expert_mlp.py"), "--shapes",
       "qwen3_30b_a3b", "--scale", "32", "--tokens", "64", "--repeats", "2",
       "--breakdown", "3", "--out", str(out)], env=env, capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "qwen3_30b_a3b: no fused run (the grouped GEMM takes lax.ragged_dot here" in result.stdout
  # Each timed program's kernels (on the CPU, no device trace: the header and that line).
  headers = [line for line in result.stdout.splitlines() if line.startswith("--- ")]
  assert len(headers) == 6, result.stdout
  assert all(" expert_mlp " in h and " unfused " in h and "µs (median)" in h for h in headers)
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert {(r["pass"], r["buffer_multiple"]) for r in records} == {
      (p, m) for p in ("fwd", "fwd_bwd") for m in (1, 2, 8)}
  for r in records:
    assert r["op"] == "expert_mlp" and r["impl"] == "unfused" and r["shape"] == "qwen3_30b_a3b"
    assert r["fused"] is False
    assert (r["experts"], r["hidden"], r["ffn"], r["topk"]) == (8, 64, 24, 8)
    assert r["rows"] == (64 // 32) * 8 and r["buffer_rows"] == r["rows"] * r["buffer_multiple"]
    assert r["precision"] == "bf16" and r["bound"] == "dense_gemm"
    assert r["median_us"] > 0 and r["tflops"] >= 0 and r["bound_tflops"] >= 0
    flops = 6 * r["rows"] * r["hidden"] * r["ffn"] * (3 if r["pass"] == "fwd_bwd" else 1)
    assert abs(r["tflops"] - round(flops / (r["median_us"] * 1e-6) / 1e12, 1)) <= 0.1
    assert r["fraction"] > 0
    assert ("padded_ratio" in r) == (r["buffer_multiple"] > 1)
    assert {"gpu", "jax", "date", "commit", "tokens_per_rank", "ranks"} <= set(r)


def test_bench_low_latency_runs_on_the_reference_backend(tmp_path):
  """No GPU here: the script runs the reference (no device trace, so no timed records) and
  still reports the fp8 round trip's error against bf16."""
  out = tmp_path / "ll.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=_xla_flags(devices=2))
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_low_latency.py"), "--tokens", "4",
       "--hidden", "256", "--experts", "16", "--topk", "4", "--layers", "2", "--repeats", "3",
       "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()]
  errors = [r for r in records if r["op"] == "fp8_error"]
  assert errors and errors[0]["mode"] == "low_latency" and errors[0]["ranks"] == 2
  assert 0 < errors[0]["max_rel_error"] < 0.1  # e4m3 rows: a few per cent at most


def test_overlap_benchmark_tells_the_ops_kernels_from_the_experts():
  """bench_overlap.py counts the CUDA kernels of the ops (namespace `jax_ep::`) as
  communication; the Mosaic GPU expert kernels, named `jax_ep_*_mosaic_gpu_kernel`, and XLA's
  are the other side."""
  import bench_overlap
  comm = ["void jax_ep::local::(anonymous namespace)::DispatchKernel<__nv_bfloat16>(...)",
          "jax_ep::rail::(anonymous namespace)::FinishKernel"]
  other = ["jax_ep_gmm_ws_mosaic_gpu_kernel", "jax_ep_mlp_gate_up_mosaic_gpu_kernel",
           "loop_convert_fusion", "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNN"]
  assert all(bench_overlap.is_comm(name) for name in comm)
  assert not any(bench_overlap.is_comm(name) for name in other)


def test_overlap_benchmark_runs_each_stream(tmp_path):
  """Tiny sizes on the CPU: one record per stream and pass, the own stream's of the layer's
  pipeline (`program: pipeline`) at each SM budget, the others' of the two halves at the
  first."""
  out = tmp_path / "overlap.jsonl"
  result = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_overlap.py"), "--tokens", "32",
       "--experts", "4", "--hidden", "64", "--ffn", "64", "--topk", "2", "--repeats", "1",
       "--num-sms", "24", "132", "--timeline", str(tmp_path / "timeline.json"),
       "--host-clock", "--out", str(out)], env=dict(os.environ, PYTHONPATH=ROOT),
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert sorted((str(r["comm_stream"]), r["num_sms"], r["pass"], r["program"])
                for r in records) == sorted(
      (str(s), n, p, "pipeline" if s == "jax_ep" else "halves")
      for s, n in ((None, 24), (1, 24), ("jax_ep", 24), ("jax_ep", 132))
      for p in ("forward", "forward_backward"))
  assert all(r["op"] == "overlap" and r["t_both_us"] > 0 for r in records)
  # No device trace on the CPU: the file is written, with no timeline in it.
  assert json.loads((tmp_path / "timeline.json").read_text()) == []


def test_overlap_timeline_draws_each_stream():
  import bench_overlap
  comm = "void jax_ep::local::(anonymous namespace)::DispatchKernel<__nv_bfloat16>(...)"
  kernels = [(1000, 51000, "jax_ep_gmm_ws_mosaic_gpu_kernel", "Stream #13"),
             (1000, 21000, comm, "Stream #40"),
             (51000, 101000, "jax_ep_gmm_ws_mosaic_gpu_kernel", "Stream #13")]
  listed, picture = bench_overlap.timeline(kernels, width=10)
  assert [(k["stream"], k["start_us"], k["us"], k["ours"]) for k in listed] == [
      ("Stream #40", 0.0, 20.0, True), ("Stream #13", 0.0, 50.0, False),
      ("Stream #13", 50.0, 50.0, False)]
  assert picture[0].endswith("|==========|") and picture[0].startswith("Stream #13")
  assert picture[1].endswith("|##        |") and picture[1].startswith("Stream #40")
  assert picture[2].rstrip().endswith("100 us")


def test_overlap_host_timeline_keeps_the_runs_long_host_events():
  import bench_overlap
  events = [(1_000, 3_000, "short", "thread 1"), (5_000, 60_000, "CustomCallThunk", "thread 1"),
            (-90_000, 20_000, "cudaStreamSynchronize", "thread 2")]
  assert bench_overlap.host_timeline(events, t0=1_000) == [
      dict(thread="thread 2", start_us=-91.0, us=110.0, name="cudaStreamSynchronize"),
      dict(thread="thread 1", start_us=4.0, us=55.0, name="CustomCallThunk")]


def test_the_traced_events_include_the_hosts_when_asked():
  """On the CPU there is no GPU stream to read, but the host's events are there."""
  import jax.numpy as jnp
  host = []
  events = timers._traced_events(lambda r: jnp.ones(8) * r, 2, host=host)
  assert events == [] and host
  assert all(len(e) == 4 and e[2] >= e[1] for e in host)
