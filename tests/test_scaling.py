"""The projection past one host (benchmarks/scaling.py) on the committed records: its invariants,
a case computed by hand, and which record each input comes from."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import scaling  # noqa: E402

T, H, F, K, E = 4096, 7168, 2048, 8, 256


@pytest.fixture(scope="module")
def committed():
  return scaling.project()


def _by(result, *keys):
  return {tuple(r[k] for k in keys): r for r in result["rows"]}


def miss_all(pool, among, picks):
  """P(no pick hits the pool), as a product: the hand form of the hypergeometric zero term."""
  p = 1.0
  for i in range(picks):
    p *= (among - pool - i) / (among - i)
  return p


def test_every_size_wire_and_overlap_is_there_finite_and_positive(committed):
  rows = _by(committed, "ep", "wire", "overlap")
  assert set(rows) == {(ep, w, o) for ep in (8, 32, 64) for w in ("bf16", "fp8")
                       for o in ("none", "overlap")}
  for r in committed["rows"]:
    for k in ("experts_us", "comm_us", "fwd_us", "bwd_us", "layer_us"):
      assert math.isfinite(r[k]) and r[k] > 0, (r, k)
    assert r["layer_us"] == pytest.approx(r["fwd_us"] + r["bwd_us"])


def test_overlap_is_never_slower_than_none(committed):
  rows = _by(committed, "ep", "wire", "overlap")
  for ep in (8, 32, 64):
    for wire in ("bf16", "fp8"):
      none, over = rows[ep, wire, "none"], rows[ep, wire, "overlap"]
      assert over["layer_us"] <= none["layer_us"]
      # and never faster than the larger of the two streams
      assert over["layer_us"] >= max(over["experts_us"], over["comm_us"])
      assert none["layer_us"] == pytest.approx(none["experts_us"] + none["comm_us"])


def test_fp8_wire_is_never_slower_than_bf16(committed):
  """FP8 rows on the wire cost less communication; the experts' FP8 time is whatever the
  records measure (it has measured slower than bf16: docs/performance.md)."""
  rows = _by(committed, "ep", "wire", "overlap")
  ops = {(o["ep"], o["wire"]): o for o in committed["ops"]}
  for ep in (8, 32, 64):
    assert ops[ep, "fp8"]["dispatch"]["us"] < ops[ep, "bf16"]["dispatch"]["us"]
    assert ops[ep, "fp8"]["combine"]["us"] == ops[ep, "bf16"]["combine"]["us"]  # bf16 combine
    assert rows[ep, "fp8", "none"]["comm_us"] < rows[ep, "bf16", "none"]["comm_us"]


def test_one_host_uses_only_nvlink(committed):
  p = committed["params"]
  ops = {(o["ep"], o["wire"]): o for o in committed["ops"]}
  for wire, row_bytes in (("bf16", 2 * H), ("fp8", H + 4 * H / 128)):
    d = ops[8, wire]["dispatch"]
    assert ops[8, wire]["network_rows"] == 0 and d["network_us"] == 0
    rate = p["nvlink_gbps"] * p["nvlink_efficiency"]["dispatch"] * 1e9
    assert d["us"] == pytest.approx(d["nvlink_bytes"] / rate * 1e6)
    assert d["nvlink_bytes"] == pytest.approx(T * 7 * (1 - miss_all(32, E, K)) * row_bytes)
  # the network's rate changes nothing inside one host, everything past it
  slow = scaling.project(network_gbps=5.0)
  for a, b in zip(committed["rows"], slow["rows"]):
    if a["ep"] == 8:
      assert b["layer_us"] == a["layer_us"]
    else:
      assert b["layer_us"] > a["layer_us"]


def test_every_input_names_a_committed_record_that_holds_it(committed):
  records = [r for name in os.listdir(scaling.RESULTS_DIR) if name.endswith(".jsonl")
             for r in scaling.load_records(scaling.RESULTS_DIR, name)]
  named = [s for s in committed["sources"] if s.get("commit")]
  assert {s["op"] for s in named} >= {"p2p_copy", "dispatch", "combine"}
  for s in named:
    same = [r for r in records if r.get("commit") == s["commit"] and r.get("op") == s["op"]
            and r.get("date") == s["date"]]
    assert same, s
    if s["op"] in ("p2p_copy", "moe_layer", "expert_mlp") or "local" in s["what"]:
      assert any(s["value"] in (r.get("gbps"), r.get("median_us")) for r in same), s
  p = committed["params"]
  p2p = [r for r in records if r.get("op") == "p2p_copy" and r.get("gbps") == p["nvlink_gbps"]]
  assert p2p and all(r["engine"] == "sm_stores" and r["num_sms"] == 24 for r in p2p)
  for op in ("dispatch", "combine"):
    eff = p["nvlink_efficiency"][op]
    assert any(r.get("op") == op and r.get("ranks") == 2 and r.get("nvlink_bytes")
               and r["nvlink_bytes"] / (r["median_us"] * 1e-6) / 1e9 / p["nvlink_gbps"]
               == pytest.approx(eff) for r in records)


def test_an_upper_bound_is_the_nearest_count_above_less_its_local_ops(committed):
  """Without a record at a rank's expert count, the experts' time is the one-rank layer's at the
  nearest count above it (the same rows in more, smaller groups), one call a step, less its own
  dispatch and combine."""
  layer = scaling.load_records(scaling.RESULTS_DIR, "layer.jsonl")
  local = sum(s["value"] for s in committed["sources"] if "R=1 local" in s["what"])
  seen = set()
  for r in committed["rows"]:
    experts = E // r["ep"]
    precision = r["wire"]
    if r["experts_basis"].startswith("upper bound"):
      seen.add(r["ep"])
      above = int(r["experts_basis"].split(" experts")[0].rsplit(" ", 1)[1])
      assert above > experts
      counts = {x["experts"] for x in layer if experts <= x.get("experts", 0) < above
                and scaling._plain_expert_record(x, "moe_layer", x["experts"], "fwd_bwd",
                                                 precision)}
      assert not counts, counts  # nothing nearer
      newest = scaling.newest(layer, lambda x: scaling._plain_expert_record(
          x, "moe_layer", above, "fwd_bwd", precision))
      assert newest.get("calls_per_step", 1) == 1
      assert r["experts_us"] == pytest.approx(newest["median_us"] - 2 * local)
    if r["experts_basis"].startswith("assumed: bf16"):
      bf16 = _by(committed, "ep", "wire", "overlap")[r["ep"], "bf16", r["overlap"]]
      assert r["experts_us"] == pytest.approx(bf16["experts_us"] / 1.6)
  assert seen == {32, 64}  # 8 and 4 experts a rank: no record at either


def test_a_case_by_hand():
  # EP=64 as 8 hosts, every remote slot crossing on its own, FP8 wire, given rates, experts at
  # 400 TF/s, two micro-batches, the experts slowed 1.25x beside the communication.
  got = scaling.project(ep_sizes=(64,), nvlink_gbps=400.0, nvlink_efficiency=0.5,
                        network_gbps=50.0, network_efficiency=0.8, network_rows="slot",
                        gemm_tflops=400.0, fp8_gemm_speedup=2.0, gemm_slowdown=1.25,
                        micro_batches=2)
  network_rows = T * K * 56 / 64  # (R - G) / R of the slots
  nvlink_rows = 8 * T * 7 * (1 - miss_all(4, E, K))  # 8 hosts' tokens, 7 other local ranks
  fp8_row, bf16_row = 7168 + 224, 14336
  dispatch = (network_rows * fp8_row / 40e9 + nvlink_rows * fp8_row / 200e9) * 1e6
  combine = (network_rows * bf16_row / 40e9 + nvlink_rows * bf16_row / 200e9) * 1e6
  c = dispatch + combine
  g_fwd = 6 * T * K * H * F / 400e12 * 1e6 / 2.0  # three GEMMs, FP8 twice as fast
  g_bwd = 2 * g_fwd

  def overlapped(g, c):  # n = 2: half the comm hides, each half's GEMMs lose 1 - 1/1.25
    return max(c + g / 2, g + c / 2 + c / 2 * 0.2)

  rows = _by(got, "wire", "overlap")
  assert got["ops"][1]["network_rows"] == pytest.approx(network_rows, abs=0.1)
  assert rows["fp8", "none"]["layer_us"] == pytest.approx(g_fwd + g_bwd + 2 * c)
  assert rows["fp8", "overlap"]["layer_us"] == pytest.approx(
      overlapped(g_fwd, c) + overlapped(g_bwd, c))
  assert scaling.pass_us(100.0, 40.0, "overlap", 2, 1.25) == pytest.approx(124.0)
  assert scaling.pass_us(100.0, 40.0, "overlap", 1, 1.25) == pytest.approx(140.0)


def test_deduplication_per_host_and_the_published_figures():
  # A token crosses once per other host holding one of its experts: fewer rows than its slots.
  for ep, hosts in ((32, 4), (64, 8)):
    host = scaling.traffic_rows(ep)
    slot = scaling.traffic_rows(ep, network_rows="slot")
    per_host = E // hosts
    assert host["network"] == pytest.approx(T * (hosts - 1) * (1 - miss_all(per_host, E, K)))
    assert host["network"] < slot["network"] == pytest.approx(T * K * (ep - 8) / ep)
  # DeepEP counts the own host's tokens too, so its GB/s on the NIC is (H - 1) / H of it: at
  # EP=32 (4 hosts) 58 GB/s is 43.5 GB/s on the wire; at EP=64 with top-4 hosts 51 -> 7/8.
  rows = {d["ep"]: d for d in scaling.project()["deepep"]}
  assert rows[32]["dispatch_nic_efficiency"] == pytest.approx(58 * 3 / 4 / 50)
  assert rows[64]["dispatch_nic_efficiency"] == pytest.approx(51 * 7 / 8 / 50)
  assert rows[8]["link"] == "nvlink"


def test_a_record_at_the_per_rank_shape_and_an_overlap_record_are_used(tmp_path):
  for name in os.listdir(scaling.RESULTS_DIR):
    shutil.copy(os.path.join(scaling.RESULTS_DIR, name), tmp_path / name)
  # Neither an FP8 record nor a layer at 32 experts: FP8 is bf16's time over the assumed
  # speedup, and the expert MLP alone is the per-rank time.
  layer = (tmp_path / "layer.jsonl").read_text().splitlines()
  (tmp_path / "layer.jsonl").write_text("".join(
      line + "\n" for line in layer if json.loads(line).get("precision") != "fp8"
      and json.loads(line).get("experts") != 32))
  base = dict(date="2099-01-01", commit="feedbee", op="expert_mlp", experts=32, hidden=H,
              ffn=F, topk=K, tokens_per_rank=T, rows=T * K, ranks=1, precision="bf16",
              impl="fused", settings="default", buffer_multiple=1)
  with open(tmp_path / "expert_mlp.jsonl", "a") as f:
    f.write(json.dumps(dict(base, **{"pass": "fwd"}, median_us=3000.0)) + "\n")
    f.write(json.dumps(dict(base, **{"pass": "fwd_bwd"}, median_us=9000.0)) + "\n")
    for other in (dict(buffer_multiple=8), dict(impl="unfused"), dict(settings={"tiles": "x"})):
      f.write(json.dumps(dict(base, **{"pass": "fwd_bwd"}, median_us=1.0, **other)) + "\n")
  with open(tmp_path / "layers.jsonl", "a") as f:
    f.write(json.dumps(dict(date="2099-01-01", commit="feedbee", op="overlap",
                            gemm_slowdown=1.1, hidden_fraction=0.8)) + "\n")
  got = scaling.project(str(tmp_path))
  rows = _by(got, "ep", "wire", "overlap")
  assert rows[8, "bf16", "none"]["experts_us"] == 9000.0
  assert rows[8, "bf16", "none"]["experts_basis"].startswith("measured: expert_mlp")
  assert rows[8, "fp8", "none"]["experts_us"] == pytest.approx(9000.0 / 1.6)
  assert rows[32, "bf16", "none"]["experts_us"] == 9000.0
  assert rows[32, "bf16", "none"]["experts_basis"] == (
      "upper bound: expert_mlp at R=1, 32 experts, bf16 (no record at 8)")
  assert got["params"]["gemm_slowdown"] == 1.1
  # With one, FP8 is what it measured, faster or not; a step of four calls is not one call.
  with open(tmp_path / "expert_mlp.jsonl", "a") as f:
    for pass_, us in (("fwd", 4000.0), ("fwd_bwd", 12000.0)):
      f.write(json.dumps(dict(base, precision="fp8", **{"pass": pass_}, median_us=us)) + "\n")
    f.write(json.dumps(dict(base, precision="fp8", **{"pass": "fwd_bwd"}, median_us=1.0,
                            calls_per_step=4)) + "\n")
  rows = _by(scaling.project(str(tmp_path)), "ep", "wire", "overlap")
  assert rows[8, "fp8", "none"]["experts_us"] == 12000.0
  assert rows[8, "fp8", "none"]["experts_basis"] == "measured: expert_mlp at 32 experts, fp8"
  assert rows[64, "fp8", "none"]["experts_us"] == 12000.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(ep_sizes=(12,)), "ep=12"),
    (dict(ep_sizes=(128,), gpus_per_host=3), "ep=128"),
    (dict(network_efficiency=1.5), "network_efficiency=1.5"),
    (dict(network_gbps=0.0), "network_gbps=0.0"),
    (dict(micro_batches=0), "micro_batches=0"),
    (dict(hops="fused"), "hops='fused'"),
    (dict(network_rows="token"), "network_rows='token'"),
    (dict(max_hosts=0, ep_sizes=(64,)), "max_hosts=0"),
    (dict(num_sms=7), "num_sms=7"),
    (dict(gemm_slowdown=0.5), "gemm_slowdown=0.5"),
])
def test_bad_arguments_name_themselves(kwargs, message):
  with pytest.raises(ValueError, match=message):
    scaling.project(**kwargs)


def test_the_command_line_prints_the_table_and_json():
  script = os.path.join(ROOT, "benchmarks", "scaling.py")
  table = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True)
  assert "| 64 | 8 | fp8 | overlap |" in table.stdout and "DeepEP" in table.stdout
  out = subprocess.run([sys.executable, script, "--json", "--ep", "8", "32"],
                       capture_output=True, text=True, check=True)
  result = json.loads(out.stdout)
  assert {r["ep"] for r in result["rows"]} == {8, 32}
  bad = subprocess.run([sys.executable, script, "--ep", "12"], capture_output=True, text=True)
  assert bad.returncode == 2 and "ep=12" in bad.stderr
