"""One DeepSeek-V3 MoE layer past one host, on paper: forward + backward time per rank at
EP = 8 (one NVLink host), 32 and 64 (4 and 8 hosts), bf16 and FP8 on the wire, with and without
overlap of communication and expert GEMMs, computed from the measured records in
`benchmarks/results/` and link rates. No GPU, no jax: it runs anywhere in well under a second.

  python benchmarks/scaling.py                    # the table (docs/scaling.md)
  python benchmarks/scaling.py --json             # the same, with every input and its source
  python benchmarks/scaling.py --network-efficiency 0.5 --gemm-tflops 500   # what-ifs

The model, per rank and per layer (the assumptions are listed in docs/scaling.md):
- Traffic. T tokens per rank pick K of E experts uniformly (optionally from at most
  `--max-hosts` hosts, as DeepSeek-V3's node-limited routing does); ranks sit G to a host. A token
  crosses the network once per other host that holds one of its experts (jax_ep's rail exchange:
  `jax_ep/backends/hierarchical.py`), then goes over NVLink once per other rank of that host that
  holds one (the host group's dispatch); combine returns the same rows. Row bytes: `H * 2` in
  bf16, `H + 4 * H / 128` in FP8 (e4m3 plus one fp32 scale per 128 channels). The layer's forward
  and backward hold two dispatches and two combines; with FP8 the dispatches (the forward's rows
  and the backward's dispatch of the combine's cotangent) are FP8 and the combines bf16.
- Communication time of one op: network bytes over `network_gbps * network_efficiency` plus
  NVLink bytes over `nvlink_gbps * nvlink_efficiency` (the rail exchange runs before the host's
  dispatch; `--hops concurrent` takes the larger of the two instead, as a fused path would).
  `nvlink_gbps`: the measured SM-store copy between two H200s at the ops' SM budget, both
  directions at once (`p2p.jsonl`); `nvlink_efficiency` per op: the NVLink bytes of the measured
  high-throughput op between two H200s over its time, over that rate (`intranode.jsonl`).
- Expert time: the measured one-rank layer (less its own local dispatch and combine) or expert
  MLP at the per-rank shape (E / EP experts, T * K rows, one call a step) when a record holds
  it; else the same at the nearest expert count above it with a record (same rows and FLOPs in
  more, smaller groups), an upper bound; FP8 without any record: the bf16 time over
  `--fp8-gemm-speedup`.
- Overlap, per pass (forward, backward), with n micro-batches: comm c, experts g; the first
  micro-batch's dispatch and the last one's combine cannot hide, nor the experts of one
  micro-batch while the comm runs past them:
  `t = max(c + g / n, g + c / n + c * (n - 1) / n * (1 - 1 / s))`, s the experts' slowdown while
  the communication kernels hold their SMs. `none` is `g + c`. n = 1 gives `g + c`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# DeepSeek-V3's MoE layer at the field's standard high-throughput shape (docs/DESIGN.md, sec. 6).
MODEL = dict(tokens_per_rank=4096, hidden=7168, ffn=2048, topk=8, experts=256)
GPUS_PER_HOST = 8
SMS_PER_GPU = 132  # H200
EP_SIZES = (8, 32, 64)
WIRES = ("bf16", "fp8")
OVERLAPS = ("none", "overlap")

# DeepEP's published figures. V1 (NVSHMEM), docs/legacy.md of deepseek-ai/DeepEP (the V1
# README), "Normal kernels with NVLink and RDMA forwarding": H800 (~160 GB/s NVLink), one CX7
# 400 Gb/s NIC per GPU (~50 GB/s), 4096 tokens per rank, H=7168, top-4 groups (hosts), top-8
# experts, FP8 dispatch, bf16 combine. GB/s by their accounting (tests/test_internode.py,
# test_intranode.py): dispatch's received rows per rank including the rank's own (intranode),
# tokens per destination host including the own host (internode, "RDMA").
DEEPEP_SOURCE = ("deepseek-ai/DeepEP docs/legacy.md (V1 README), commit 0297fc8: H800, CX7 "
                 "400 Gb/s, 4096 tokens, top-4 groups, top-8, FP8 dispatch, bf16 combine")
DEEPEP_V1 = {8: ("nvlink", 153.0, 158.0), 16: ("rdma", 43.0, 43.0), 32: ("rdma", 58.0, 57.0),
             64: ("rdma", 51.0, 50.0)}
DEEPEP_V1_TOPK_GROUPS = 4


# --------------------------------------------------------------------------- records

def load_records(results_dir: str, name: str) -> list[dict]:
  """The records of `results_dir/name` in file order (appended, so later is newer)."""
  path = os.path.join(results_dir, name)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def newest(records: list[dict], keep) -> dict | None:
  """The newest record for which `keep(record)` holds: the latest date, and among one date the
  last in the file."""
  found = [(r.get("date", ""), i) for i, r in enumerate(records) if keep(r)]
  return records[max(found)[1]] if found else None


def source(record: dict, what: str, value) -> dict:
  """Where an input comes from: the record's commit, date, op and timing."""
  return {"what": what, "value": value, "commit": record.get("commit"),
          "date": record.get("date"), "op": record.get("op"), "timing": record.get("timing")}


def _model_shape(r: dict) -> bool:
  return all(r.get(k) == MODEL[k] for k in ("tokens_per_rank", "hidden", "topk", "experts"))


def nvlink_inputs(results_dir: str, num_sms: int) -> dict:
  """The NVLink rate (`p2p.jsonl`) and each op's efficiency on it (`intranode.jsonl`)."""
  p2p = newest(load_records(results_dir, "p2p.jsonl"),
               lambda r: (r.get("op") == "p2p_copy" and r.get("engine") == "sm_stores"
                          and r.get("num_sms") == num_sms and r.get("directions") == "both"))
  if p2p is None:
    raise ValueError(f"num_sms={num_sms}: p2p.jsonl holds no SM-store copy (both directions) "
                     "at that budget; pass --nvlink-gbps and --nvlink-efficiency")
  out = {"nvlink_gbps": p2p["gbps"],
         "sources": [source(p2p, "NVLink GB/s: SM-store copy between two H200s, both "
                                 "directions at once", p2p["gbps"])]}
  out.update(op_efficiencies(results_dir, num_sms, p2p["gbps"], out["sources"]))
  return out


def op_efficiencies(results_dir: str, num_sms: int, nvlink_gbps: float, sources: list) -> dict:
  """Per op: the NVLink bytes of the measured two-GPU op over its time, over `nvlink_gbps`."""
  intranode = load_records(results_dir, "intranode.jsonl")
  out = {}
  for op in ("dispatch", "combine"):
    r = newest(intranode, lambda r: (
        r.get("op") == op and r.get("backend") == "cuda" and r.get("ranks") == 2
        and r.get("process_model") == "process_per_gpu" and _model_shape(r)
        and r.get("timing") == "device_clock_steady" and r.get("num_sms") == num_sms
        and r.get("routing") in (None, "uniform") and r.get("nvlink_bytes")
        and r.get("wire_dtype") in (None, "bfloat16")))
    if r is None:
      raise ValueError(f"num_sms={num_sms}: intranode.jsonl holds no two-GPU {op} at the "
                       "model's shape and that budget; pass --nvlink-efficiency")
    rate = r["nvlink_bytes"] / (r["median_us"] * 1e-6) / 1e9
    out[op] = rate / nvlink_gbps
    sources.append(source(r, f"{op} NVLink efficiency: {r['nvlink_bytes']} NVLink bytes in "
                             f"{r['median_us']} us = {rate:.1f} GB/s, over {nvlink_gbps} GB/s",
                          round(out[op], 3)))
  return {"nvlink_efficiency": out}


def overlap_slowdown(results_dir: str, num_sms: int) -> tuple[float, list]:
  """The experts' slowdown while the communication kernels run beside them: the newest measured
  `overlap` record's `gemm_slowdown`, else the SMs the kernels take (`num_sms` of 132)."""
  best = None
  for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
    if name.endswith(".jsonl"):
      r = newest(load_records(results_dir, name),
                 lambda r: r.get("op") == "overlap" and r.get("gemm_slowdown"))
      if r is not None and (best is None or r.get("date", "") >= best.get("date", "")):
        best = r
  if best is not None:
    return best["gemm_slowdown"], [source(best, "overlap: the experts' slowdown beside the "
                                                "communication (measured)", best["gemm_slowdown"])]
  s = SMS_PER_GPU / (SMS_PER_GPU - num_sms)
  return s, [{"what": f"overlap: the experts' slowdown beside the communication, assumed "
                      f"{SMS_PER_GPU}/({SMS_PER_GPU}-{num_sms}) (no overlap record)",
              "value": round(s, 3)}]


def _rows(r: dict):
  if r.get("rows") is not None:
    return r["rows"]
  if r.get("tokens_per_rank") is not None and r.get("topk") is not None:
    return r["tokens_per_rank"] * r["topk"]
  return None


def _plain_expert_record(r: dict, op: str, experts: int, pass_: str, precision: str) -> bool:
  """A record of `op` at the model's H, F and rows with `experts` experts: one rank, jax_ep's own
  kernels at their defaults (`moe_layer`'s `mosaic`, `expert_mlp`'s `fused`; FP8 weight
  gradients in FP8), one call a step (N calls that share their weights also pay for summing
  their weight gradients, which one layer's call does not), no padded or re-aligned buffer."""
  return (r.get("op") == op and r.get("experts") == experts and r.get("hidden") == MODEL["hidden"]
          and r.get("ffn") == MODEL["ffn"] and r.get("pass") == pass_
          and _rows(r) == MODEL["tokens_per_rank"] * MODEL["topk"]
          and (r.get("precision") or "bf16") == precision and r.get("ranks", 1) == 1
          and r.get("impl", "mosaic") in ("mosaic", "fused")
          and r.get("settings", "default") == "default"
          and r.get("weight_grad") in (None, "fp8") and r.get("calls_per_step", 1) == 1
          and r.get("padded_rows") is None and r.get("buffer_multiple", 1) == 1
          and r.get("expert_alignment", 1) == 1)


def local_comm_us(results_dir: str) -> tuple[float, list]:
  """One rank's own dispatch + combine (no peer) at the model's shape: the R=1 layer record spends
  this on them in each pass; it comes out before the inter-rank communication goes in."""
  local = load_records(results_dir, "local.jsonl")
  total, sources = 0.0, []
  for op in ("dispatch", "combine"):
    r = newest(local, lambda r: (r.get("op") == op and r.get("backend") == "cuda"
                                 and r.get("ranks") == 1 and _model_shape(r)
                                 and r.get("timing") == "device_trace_single"
                                 and r.get("wire_dtype") in (None, "bfloat16")))
    if r is None:
      return 0.0, [{"what": f"R=1 local {op}: no record, nothing subtracted", "value": 0.0}]
    total += r["median_us"]
    sources.append(source(r, f"R=1 local {op} (subtracted from each pass)", r["median_us"]))
  return total, sources


def expert_times(results_dir: str, ep: int, precision: str, fp8_gemm_speedup: float,
                 gemm_tflops: float | None = None) -> dict:
  """One rank's experts at EP=`ep`: `{"fwd", "bwd", "basis", "sources"}`, times in µs (the
  backward alone: its two GEMMs per forward GEMM)."""
  m = MODEL
  experts_local = m["experts"] // ep
  if gemm_tflops is not None:
    rows = m["tokens_per_rank"] * m["topk"]
    fwd = 3 * 2.0 * rows * m["hidden"] * m["ffn"] / (gemm_tflops * 1e12) * 1e6  # gate, up, down
    speed = fp8_gemm_speedup if precision == "fp8" else 1.0
    basis = f"assumed: {gemm_tflops:g} TF/s" + (f" / {fp8_gemm_speedup:g} for FP8"
                                                 if precision == "fp8" else "")
    return {"fwd": fwd / speed, "bwd": 2 * fwd / speed, "basis": basis, "sources": []}
  records = {"moe_layer": load_records(results_dir, "layer.jsonl"),
             "expert_mlp": load_records(results_dir, "expert_mlp.jsonl")}

  def measured(op, experts, prec):
    f = newest(records[op], lambda r: _plain_expert_record(r, op, experts, "fwd", prec))
    b = newest(records[op], lambda r: _plain_expert_record(r, op, experts, "fwd_bwd", prec))
    if not (f and b):
      return None
    # The layer record holds its own local dispatch and combine in each pass; the expert MLP
    # record holds nothing else.
    sub, subs = local_comm_us(results_dir) if op == "moe_layer" else (0.0, [])
    return {"fwd": f["median_us"] - sub, "bwd": b["median_us"] - f["median_us"] - sub,
            "sources": [source(f, f"{op} fwd, {experts} experts, {prec}", f["median_us"]),
                        source(b, f"{op} fwd_bwd, {experts} experts, {prec}", b["median_us"])]
                       + subs}

  # The layer first (it holds the router as the projection's experts do), then the expert MLP
  # alone. Without a record at this rank's expert count, the nearest count above it: the same
  # rows and FLOPs in more, smaller groups (more partial tiles, more weight bytes) bound fewer,
  # larger ones from above.
  counts = sorted({r["experts"] for op, rs in records.items() for r in rs
                   if r.get("experts", 0) > experts_local
                   and _plain_expert_record(r, op, r["experts"], "fwd_bwd", precision)})
  for experts in [experts_local, *counts]:
    for op in ("moe_layer", "expert_mlp"):
      got = measured(op, experts, precision)
      if got:
        basis = (f"measured: {op} at {experts} experts, {precision}" if experts == experts_local
                 else f"upper bound: {op} at R=1, {experts} experts, {precision} (no record at "
                      f"{experts_local})")
        return dict(got, basis=basis)
  if precision == "fp8":
    bf16 = expert_times(results_dir, ep, "bf16", fp8_gemm_speedup)
    return {"fwd": bf16["fwd"] / fp8_gemm_speedup, "bwd": bf16["bwd"] / fp8_gemm_speedup,
            "basis": f"assumed: bf16 ({bf16['basis']}) / {fp8_gemm_speedup:g}",
            "sources": bf16["sources"]}
  raise ValueError("layer.jsonl and expert_mlp.jsonl hold no record of the experts at the "
                   f"model's shape with {experts_local} or more experts (moe_layer or "
                   "expert_mlp, fwd and fwd_bwd); pass --gemm-tflops")


# --------------------------------------------------------------------------- traffic

def p_hit(pool: int, among: int, picks: int) -> float:
  """The probability that `picks` draws without replacement from `among` experts hit at least one
  of a given `pool` of them."""
  if among - pool < picks:
    return 1.0
  return 1.0 - math.comb(among - pool, picks) / math.comb(among, picks)


def row_bytes(wire: str, hidden: int = MODEL["hidden"]) -> float:
  """Bytes of one row on the wire: bf16, or e4m3 with one fp32 scale per 128 channels."""
  if wire == "bf16":
    return 2.0 * hidden
  if wire == "fp8":
    return hidden + 4.0 * hidden / 128
  raise ValueError(f"wire={wire!r}: expected 'bf16' or 'fp8'")


def traffic_rows(ep: int, *, gpus_per_host: int = GPUS_PER_HOST, max_hosts: int | None = None,
                 network_rows: str = "host", m: dict = MODEL) -> dict:
  """Rows one rank sends per dispatch (combine returns as many), expected under uniform routing:
  `network` to other hosts, `nvlink` to other ranks of its host; and the host and rank counts.

  A token picks `max_hosts` of the hosts uniformly (all of them when None), then its `topk`
  experts uniformly among theirs. `network_rows="host"`: a token crosses once per other host that
  holds one of its experts (jax_ep's rail exchange); `"slot"`: once per selected slot on another
  host, `T * K * (R - G) / R` (no deduplication; an upper bound). Each rank forwards the tokens
  of every host's rank of its local index to the other ranks of its host that need them."""
  if ep < 1 or m["experts"] % ep:
    raise ValueError(f"ep={ep}: expected a divisor of the {m['experts']} experts")
  g = min(ep, gpus_per_host)
  if ep % g:
    raise ValueError(f"ep={ep}: expected a multiple of gpus_per_host={gpus_per_host} (or fewer)")
  hosts = ep // g
  limit = hosts if max_hosts is None else min(max_hosts, hosts)
  if limit < 1:
    raise ValueError(f"max_hosts={max_hosts}: expected at least 1")
  per_host, per_rank = m["experts"] // hosts, m["experts"] // ep
  pool = limit * per_host
  if pool < m["topk"]:
    raise ValueError(f"max_hosts={max_hosts}: {limit} hosts hold {pool} experts, fewer than "
                     f"topk={m['topk']}")
  host_used = limit / hosts * p_hit(per_host, pool, m["topk"])
  rank_used = limit / hosts * p_hit(per_rank, pool, m["topk"])
  t = m["tokens_per_rank"]
  if network_rows == "host":
    network = t * (hosts - 1) * host_used
  elif network_rows == "slot":
    network = t * m["topk"] * (hosts - 1) / hosts
  else:
    raise ValueError(f"network_rows={network_rows!r}: expected 'host' or 'slot'")
  return {"hosts": hosts, "gpus_per_host": g, "network": network,
          "nvlink": hosts * t * (g - 1) * rank_used,
          "hosts_per_token": hosts * host_used, "ranks_per_token": ep * rank_used}


# --------------------------------------------------------------------------- time

def op_us(rows: dict, wire: str, op: str, p: dict) -> dict:
  """One dispatch or combine: its network and NVLink bytes and time (µs) per rank."""
  b = row_bytes(wire)
  net_b, nvl_b = rows["network"] * b, rows["nvlink"] * b
  t_net = net_b / (p["network_gbps"] * p["network_efficiency"] * 1e9) * 1e6
  t_nvl = nvl_b / (p["nvlink_gbps"] * p["nvlink_efficiency"][op] * 1e9) * 1e6
  t = max(t_net, t_nvl) if p["hops"] == "concurrent" else t_net + t_nvl
  return {"network_bytes": net_b, "nvlink_bytes": nvl_b, "network_us": t_net,
          "nvlink_us": t_nvl, "us": t}


def pass_us(g: float, c: float, overlap: str, micro_batches: int, slowdown: float) -> float:
  """One pass (forward or backward) of experts `g` and communication `c`, µs."""
  if overlap == "none":
    return g + c
  n = micro_batches
  hidden_comm = c * (n - 1) / n  # what runs beside the experts of another micro-batch
  return max(c + g / n, g + c / n + hidden_comm * (1 - 1 / slowdown))


def project(results_dir: str = RESULTS_DIR, *, ep_sizes=EP_SIZES, num_sms: int = 24,
            nvlink_gbps: float | None = None, nvlink_efficiency: float | None = None,
            network_gbps: float = 50.0, network_efficiency: float = 0.85,
            gpus_per_host: int = GPUS_PER_HOST, max_hosts: int | None = None,
            network_rows: str = "host", hops: str = "sequential", micro_batches: int = 2,
            gemm_slowdown: float | None = None, fp8_gemm_speedup: float = 1.6,
            gemm_tflops: float | None = None) -> dict:
  """The projection: `{"rows", "ops", "deepep", "params", "sources"}` (see the module doc)."""
  for name, v, most in (("network_gbps", network_gbps, math.inf),
                        ("network_efficiency", network_efficiency, 1.0),
                        ("fp8_gemm_speedup", fp8_gemm_speedup, math.inf),
                        ("nvlink_gbps", nvlink_gbps, math.inf),
                        ("nvlink_efficiency", nvlink_efficiency, 1.0),
                        ("gemm_tflops", gemm_tflops, math.inf)):
    if v is None and name in ("nvlink_gbps", "nvlink_efficiency", "gemm_tflops"):
      continue  # taken from the records
    if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= most):
      bound = "in (0, 1]" if most == 1.0 else "> 0"
      raise ValueError(f"{name}={v!r}: expected a finite number {bound}")
  if not (isinstance(micro_batches, int) and micro_batches >= 1):
    raise ValueError(f"micro_batches={micro_batches!r}: expected an integer >= 1")
  if hops not in ("sequential", "concurrent"):
    raise ValueError(f"hops={hops!r}: expected 'sequential' or 'concurrent'")
  if not (isinstance(num_sms, int) and 0 < num_sms < SMS_PER_GPU):
    raise ValueError(f"num_sms={num_sms!r}: expected an integer in [1, {SMS_PER_GPU - 1}]")
  if gemm_slowdown is not None and not (math.isfinite(gemm_slowdown) and gemm_slowdown >= 1):
    raise ValueError(f"gemm_slowdown={gemm_slowdown!r}: expected a number >= 1")

  sources = []
  if nvlink_gbps is None:
    nvl = nvlink_inputs(results_dir, num_sms)
    nvlink_gbps = nvl["nvlink_gbps"]
    sources += nvl["sources"]
    effs = nvl["nvlink_efficiency"]
  else:
    sources.append({"what": "NVLink GB/s (given)", "value": nvlink_gbps})
    effs = (None if nvlink_efficiency is None
            else {"dispatch": nvlink_efficiency, "combine": nvlink_efficiency})
    if effs is None:
      effs = op_efficiencies(results_dir, num_sms, nvlink_gbps, sources)["nvlink_efficiency"]
  if nvlink_efficiency is not None:
    effs = {"dispatch": nvlink_efficiency, "combine": nvlink_efficiency}
    sources.append({"what": "NVLink efficiency of both ops (given)", "value": nvlink_efficiency})
  if gemm_slowdown is None:
    gemm_slowdown, s = overlap_slowdown(results_dir, num_sms)
    sources += s
  else:
    sources.append({"what": "the experts' slowdown beside the communication (given)",
                    "value": gemm_slowdown})
  p = dict(nvlink_gbps=nvlink_gbps, nvlink_efficiency=effs, network_gbps=network_gbps,
           network_efficiency=network_efficiency, hops=hops)

  rows_out, ops_out, seen = [], [], set()
  for ep in ep_sizes:
    traffic = traffic_rows(ep, gpus_per_host=gpus_per_host, max_hosts=max_hosts,
                           network_rows=network_rows)
    for wire in WIRES:
      experts = expert_times(results_dir, ep, wire, fp8_gemm_speedup, gemm_tflops)
      for s in experts["sources"]:
        if json.dumps(s, sort_keys=True) not in seen:
          seen.add(json.dumps(s, sort_keys=True))
          sources.append(s)
      # Forward: dispatch (the wire's rows) and combine (bf16); backward: the combine's
      # cotangent dispatched (the wire's rows) and the dispatch's cotangent combined (bf16).
      d = op_us(traffic, wire, "dispatch", p)
      c = op_us(traffic, "bf16", "combine", p)
      comm = d["us"] + c["us"]
      ops_out.append({"ep": ep, "hosts": traffic["hosts"], "wire": wire,
                      "network_rows": round(traffic["network"], 1),
                      "nvlink_rows": round(traffic["nvlink"], 1),
                      "dispatch": d, "combine": c})
      for overlap in OVERLAPS:
        fwd = pass_us(experts["fwd"], comm, overlap, micro_batches, gemm_slowdown)
        bwd = pass_us(experts["bwd"], comm, overlap, micro_batches, gemm_slowdown)
        rows_out.append({"ep": ep, "hosts": traffic["hosts"], "wire": wire, "overlap": overlap,
                         "experts_us": experts["fwd"] + experts["bwd"], "comm_us": 2 * comm,
                         "fwd_us": fwd, "bwd_us": bwd, "layer_us": fwd + bwd,
                         "experts_basis": experts["basis"]})
  return {"rows": rows_out, "ops": ops_out, "deepep": deepep_beside(p, gpus_per_host),
          "params": dict(MODEL, ep_sizes=list(ep_sizes), num_sms=num_sms,
                         nvlink_gbps=nvlink_gbps, nvlink_efficiency=effs,
                         network_gbps=network_gbps, network_efficiency=network_efficiency,
                         gpus_per_host=gpus_per_host, max_hosts=max_hosts,
                         network_rows=network_rows, hops=hops, micro_batches=micro_batches,
                         gemm_slowdown=gemm_slowdown, fp8_gemm_speedup=fp8_gemm_speedup,
                         gemm_tflops=gemm_tflops),
          "sources": sources}


def deepep_beside(p: dict, gpus_per_host: int) -> list[dict]:
  """DeepEP V1's published figures as µs per op at its test's traffic (their accounting), beside
  this model's µs for the same traffic (FP8 dispatch, bf16 combine, top-4 hosts) and the network
  efficiency their figures imply (their logical bytes include the own host's tokens)."""
  out = []
  for ep, (link, gbps_d, gbps_c) in sorted(DEEPEP_V1.items()):
    traffic = traffic_rows(ep, gpus_per_host=gpus_per_host, max_hosts=DEEPEP_V1_TOPK_GROUPS)
    t = MODEL["tokens_per_rank"]
    # Their rows: received per rank including its own (intranode); sent per host including
    # the own host (internode).
    logical = t * (traffic["ranks_per_token"] if link == "nvlink" else traffic["hosts_per_token"])
    row = {"ep": ep, "link": link, "dispatch_gbps": gbps_d, "combine_gbps": gbps_c}
    for op, wire, gbps in (("dispatch", "fp8", gbps_d), ("combine", "bf16", gbps_c)):
      row[f"{op}_us"] = logical * row_bytes(wire) / (gbps * 1e9) * 1e6
      row[f"model_{op}_us"] = op_us(traffic, wire, op, p)["us"]
      if link == "rdma":
        row[f"{op}_nic_efficiency"] = (traffic["network"] * row_bytes(wire)
                                       / (row[f"{op}_us"] * 1e-6) / 1e9 / p["network_gbps"])
    out.append(row)
  return out


# --------------------------------------------------------------------------- report

def print_report(result: dict, file=sys.stdout) -> None:
  pr = lambda *a: print(*a, file=file)  # noqa: E731
  pa = result["params"]
  pr(f"DeepSeek-V3 MoE layer, forward + backward per rank: T={pa['tokens_per_rank']} tokens per "
     f"rank, H={pa['hidden']}, F={pa['ffn']}, top-{pa['topk']} of {pa['experts']} experts; "
     f"{pa['gpus_per_host']} GPUs per host; micro-batches {pa['micro_batches']}; times in us.")
  pr("")
  pr("| EP | hosts | wire | overlap | experts | dispatch + combine, x2 | layer fwd + bwd |")
  pr("| --- | --- | --- | --- | --- | --- | --- |")
  for r in result["rows"]:
    pr(f"| {r['ep']} | {r['hosts']} | {r['wire']} | {r['overlap']} | {r['experts_us']:.0f} | "
       f"{r['comm_us']:.0f} | {r['layer_us']:.0f} |")
  pr("")
  bases = {}
  for r in result["rows"]:
    bases.setdefault(r["experts_basis"], []).append(f"EP={r['ep']} {r['wire']}")
  pr("Experts' time:")
  for basis, where in bases.items():
    pr(f"- {', '.join(dict.fromkeys(where))}: {basis}")
  pr("")
  pr("Per op (one dispatch, one combine; rows per rank, expected):")
  pr("")
  pr("| EP | wire | network rows | NVLink rows | dispatch network / NVLink / total | "
     "combine (bf16) total |")
  pr("| --- | --- | --- | --- | --- | --- |")
  for o in result["ops"]:
    d, c = o["dispatch"], o["combine"]
    pr(f"| {o['ep']} | {o['wire']} | {o['network_rows']:.0f} | {o['nvlink_rows']:.0f} | "
       f"{d['network_us']:.0f} / {d['nvlink_us']:.0f} / {d['us']:.0f} | {c['us']:.0f} |")
  pr("")
  pr(f"DeepEP V1, published ({DEEPEP_SOURCE}), as us per op at its traffic, beside this model "
     "for the same traffic:")
  pr("")
  pr("| EP | link | dispatch GB/s -> us | combine GB/s -> us | model dispatch / combine | "
     "implied NIC efficiency (dispatch / combine) |")
  pr("| --- | --- | --- | --- | --- | --- |")
  for d in result["deepep"]:
    eff = (f"{d['dispatch_nic_efficiency']:.2f} / {d['combine_nic_efficiency']:.2f}"
           if d["link"] == "rdma" else "-")
    pr(f"| {d['ep']} | {d['link']} | {d['dispatch_gbps']:g} -> {d['dispatch_us']:.0f} | "
       f"{d['combine_gbps']:g} -> {d['combine_us']:.0f} | {d['model_dispatch_us']:.0f} / "
       f"{d['model_combine_us']:.0f} | {eff} |")
  pr("")
  pr("Inputs:")
  for s in result["sources"]:
    where = ", ".join(f"{k} {s[k]}" if k == "commit" else str(s[k])
                      for k in ("commit", "date", "op", "timing") if s.get(k))
    where = f" ({where})" if where else ""
    pr(f"- {s['what']}: {s['value']}{where}")
  eff = pa["nvlink_efficiency"]
  pr(f"- network: {pa['network_gbps']:g} GB/s x {pa['network_efficiency']:g}; NVLink "
     f"{pa['nvlink_gbps']:g} GB/s x {eff['dispatch']:.3f} (dispatch) / {eff['combine']:.3f} "
     f"(combine); hops {pa['hops']}; network rows per {pa['network_rows']}; max hosts per "
     f"token {pa['max_hosts'] or 'all'}; FP8 experts {pa['fp8_gemm_speedup']:g}x bf16 where "
     f"not measured; experts' slowdown beside the communication {pa['gemm_slowdown']:.3f}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--results", default=RESULTS_DIR, help="the records' folder")
  parser.add_argument("--ep", type=int, nargs="+", default=list(EP_SIZES),
                      help="EP sizes (default 8 32 64)")
  parser.add_argument("--num-sms", type=int, default=24,
                      help="the communication kernels' SM budget; picks the records (default 24)")
  parser.add_argument("--nvlink-gbps", type=float, default=None,
                      help="per-GPU NVLink egress, GB/s (default: p2p.jsonl's SM-store copy "
                           "between two H200s, both directions, at --num-sms)")
  parser.add_argument("--nvlink-efficiency", type=float, default=None,
                      help="fraction of --nvlink-gbps the ops reach (default: per op, measured "
                           "between two H200s in intranode.jsonl)")
  parser.add_argument("--network-gbps", type=float, default=50.0,
                      help="per-GPU network rate, GB/s (default 50: 400 Gb/s)")
  parser.add_argument("--network-efficiency", type=float, default=0.85,
                      help="fraction of --network-gbps the ops reach (default 0.85; DeepEP's "
                           "published internode figures imply 0.86-0.89, printed below)")
  parser.add_argument("--gpus-per-host", type=int, default=GPUS_PER_HOST)
  parser.add_argument("--max-hosts", type=int, default=None,
                      help="hosts a token's experts may span (DeepSeek-V3 trains with 4; "
                           "default: no limit, uniform routing)")
  parser.add_argument("--network-rows", choices=("host", "slot"), default="host",
                      help="a token crosses once per other host (jax_ep's rail exchange, "
                           "default) or once per selected slot on another host")
  parser.add_argument("--hops", choices=("sequential", "concurrent"), default="sequential",
                      help="network then NVLink (jax_ep's hierarchical path, default) or both "
                           "at once (a fused path)")
  parser.add_argument("--micro-batches", type=int, default=2)
  parser.add_argument("--gemm-slowdown", type=float, default=None,
                      help="the experts' slowdown while the communication runs beside them "
                           "(default: a measured overlap record, else 132 / (132 - num_sms))")
  parser.add_argument("--fp8-gemm-speedup", type=float, default=1.6,
                      help="FP8 experts' speed over bf16 where no FP8 record exists (default "
                           "1.6: XLA's FP8 dot over bf16 at 32768x7168x2048 on an H200, 1.63)")
  parser.add_argument("--gemm-tflops", type=float, default=None,
                      help="assume the bf16 experts run at this rate (TF/s) instead of the "
                           "records")
  parser.add_argument("--json", action="store_true", help="print JSON instead of the tables")
  args = parser.parse_args(argv)
  try:
    result = project(args.results, ep_sizes=tuple(args.ep), num_sms=args.num_sms,
                     nvlink_gbps=args.nvlink_gbps, nvlink_efficiency=args.nvlink_efficiency,
                     network_gbps=args.network_gbps, network_efficiency=args.network_efficiency,
                     gpus_per_host=args.gpus_per_host, max_hosts=args.max_hosts,
                     network_rows=args.network_rows, hops=args.hops,
                     micro_batches=args.micro_batches, gemm_slowdown=args.gemm_slowdown,
                     fp8_gemm_speedup=args.fp8_gemm_speedup, gemm_tflops=args.gemm_tflops)
  except ValueError as e:
    parser.error(str(e))
  if args.json:
    json.dump(result, sys.stdout, indent=1)
    print()
  else:
    print_report(result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
