"""Dense, obviously-correct oracle for jax_ep's semantics (numpy, loops, all ranks in one place).

Independent of every backend: no sorting tricks, no collectives. Tests compare the reference and
cuda backends against these functions. Everything here takes the inputs of *all* ranks at once:
`x` `[R, T, H]`, `topk_idx` `[R, T, K]`, `topk_weights` `[R, T, K]`.
"""

from __future__ import annotations

import numpy as np


def default_capacity(num_ranks: int, max_tokens_per_rank: int, num_topk: int,
                     num_local_experts: int, expert_alignment: int = 1) -> int:
  return (num_ranks * max_tokens_per_rank * min(num_topk, num_local_experts)
          + num_local_experts * (expert_alignment - 1))


def _routed_slots(topk_idx: np.ndarray, num_experts: int, dst: int, num_local_experts: int,
                  merge: bool):
  """Rows that land on rank `dst`, as (local_expert, src_rank, token, slots) in contract order.

  Visits slots in (src_rank, token, slot) order and appends each to its expert's list, so every
  list is in that order; the lists are then concatenated by local expert. With `merge`, the
  slots of one token that name the same expert make one row (`slots` lists them all); else
  every slot is a row of its own (`slots` has one entry).
  """
  num_ranks, num_tokens, num_topk = topk_idx.shape
  per_expert = [[] for _ in range(num_local_experts)]
  for s in range(num_ranks):
    for t in range(num_tokens):
      rows_of_token = {}
      for k in range(num_topk):
        e = int(topk_idx[s, t, k])
        if not (0 <= e < num_experts and e // num_local_experts == dst):
          continue
        if merge and e in rows_of_token:
          rows_of_token[e].append(k)
          continue
        slots = [k]
        rows_of_token[e] = slots
        per_expert[e % num_local_experts].append((e % num_local_experts, s, t, slots))
  return [(le, s, t, tuple(slots)) for rows in per_expert for (le, s, t, slots) in rows]


def dispatch(x, topk_idx, num_experts: int, capacity: int, *, merge: bool = True,
             expert_alignment: int = 1):
  """High-throughput dispatch for every rank.

  Returns a list over destination ranks of dicts with `recv_x` `[capacity, H]` (dtype of x;
  zeros in the rows no token went to), `group_sizes` `[L]`, `group_offsets` `[L]`,
  `num_dropped`, `rows`: for each kept row the (src_rank, token, slots) it came from, and
  `row_index`: the row of `recv_x` each of them is (both used by `combine`). `merge=False`
  gives one row per slot (the plain-XLA baseline's layout) instead of the contract's one row
  per (token, expert). `expert_alignment`: each expert's rows start at a multiple of it.
  """
  x = np.asarray(x)
  topk_idx = np.asarray(topk_idx)
  num_ranks, _, hidden = x.shape
  num_local = num_experts // num_ranks
  out = []
  for d in range(num_ranks):
    slots = _routed_slots(topk_idx, num_experts, d, num_local, merge)
    recv_x = np.zeros((capacity, hidden), x.dtype)
    group_sizes = np.zeros(num_local, np.int32)
    group_offsets = np.zeros(num_local, np.int32)
    per_expert = [[] for _ in range(num_local)]
    for (le, s, t, ks) in slots:
      per_expert[le].append((s, t, ks))
    rows, row_index = [], []
    start = 0  # where the next expert's rows start
    for le in range(num_local):
      group_offsets[le] = min(start, capacity)
      row = start
      for (s, t, ks) in per_expert[le]:
        if row < capacity:  # a row that does not fit is dropped
          recv_x[row] = x[s, t]
          rows.append((s, t, ks))
          row_index.append(row)
          group_sizes[le] += 1
        row += 1
      kept = int(group_sizes[le])
      start += -(-kept // expert_alignment) * expert_alignment
    out.append(dict(recv_x=recv_x, group_sizes=group_sizes, group_offsets=group_offsets,
                    num_dropped=np.int32(len(slots) - len(rows)), rows=rows,
                    row_index=row_index))
  return out


def num_invalid(topk_idx, num_experts: int):
  """Per rank: slots whose id is neither -1 nor in [0, E)."""
  topk_idx = np.asarray(topk_idx)
  return ((topk_idx < -1) | (topk_idx >= num_experts)).sum(axis=(1, 2)).astype(np.int32)


def combine(expert_out, dispatched, topk_weights, out_dtype, *, weighted: bool = True):
  """High-throughput combine: `expert_out` is a list over ranks of `[capacity, H]` arrays.

  out[s, t] = sum over kept slots (s, t, k) of w[s, t, k] * expert_out[dst][row], in float64
  (the oracle is exact-ish; the backends accumulate in fp32 and are compared with a tolerance).
  A row shared by several slots of a token counts once per slot when weighted (its weight is
  theirs summed) and once when unweighted (the transpose of a dispatch that sent it once).
  """
  topk_weights = np.asarray(topk_weights, np.float64)
  num_ranks, num_tokens, _ = topk_weights.shape
  hidden = np.asarray(expert_out[0]).shape[-1]
  out = np.zeros((num_ranks, num_tokens, hidden), np.float64)
  for d, info in enumerate(dispatched):
    eo = np.asarray(expert_out[d], np.float64)
    for row, (s, t, ks) in zip(info.get("row_index", range(len(info["rows"]))), info["rows"]):
      w = sum(topk_weights[s, t, k] for k in ks) if weighted else 1.0
      out[s, t] += w * eo[row]
  return out.astype(out_dtype)


def low_latency_dispatch(x, topk_idx, num_experts: int, max_tokens_per_rank: int):
  """Low-latency dispatch: per rank `recv_x` `[L, R*T_max, H]`, `count` `[L]`, `num_dropped`, `rows`."""
  x = np.asarray(x)
  topk_idx = np.asarray(topk_idx)
  num_ranks, _, hidden = x.shape
  num_local = num_experts // num_ranks
  slab = num_ranks * max_tokens_per_rank
  out = []
  for d in range(num_ranks):
    # Slots of one token naming the same expert are one row (merged, as in `dispatch`).
    slots = _routed_slots(topk_idx, num_experts, d, num_local, merge=True)
    recv_x = np.zeros((num_local, slab, hidden), x.dtype)
    count = np.zeros(num_local, np.int32)
    rows = {}
    dropped = 0
    for le, s, t, ks in slots:
      if count[le] < slab:
        recv_x[le, count[le]] = x[s, t]
        rows[(s, t, ks)] = (le, int(count[le]))
        count[le] += 1
      else:
        dropped += 1
    out.append(dict(recv_x=recv_x, count=count, num_dropped=np.int32(dropped), rows=rows))
  return out


def low_latency_combine(expert_out, dispatched, topk_weights, out_dtype):
  topk_weights = np.asarray(topk_weights, np.float64)
  num_ranks, num_tokens, _ = topk_weights.shape
  hidden = np.asarray(expert_out[0]).shape[-1]
  out = np.zeros((num_ranks, num_tokens, hidden), np.float64)
  for d, info in enumerate(dispatched):
    eo = np.asarray(expert_out[d], np.float64)
    for (s, t, ks), (le, j) in info["rows"].items():
      out[s, t] += sum(topk_weights[s, t, k] for k in ks) * eo[le, j]
  return out.astype(out_dtype)


def _round_up_power_of_two(scales):
  """The smallest power of two >= each float32 scale, on the bits (as the kernels do): a
  normal scale's exponent, plus one where its mantissa is not zero; a subnormal's next power of
  two (0 stays 0); infinity stays."""
  bits = np.asarray(scales, np.float32).view(np.uint32)
  exponent, mantissa = bits & np.uint32(0x7F800000), bits & np.uint32(0x007FFFFF)
  normal = np.where(mantissa == 0, bits, exponent + np.uint32(0x00800000))
  high = np.array([int(m).bit_length() for m in mantissa.reshape(-1)],
                  np.uint32).reshape(mantissa.shape)
  subnormal = np.where((mantissa & (mantissa - np.uint32(1))) == 0, bits,
                       np.left_shift(np.uint32(1), high))
  return np.where(exponent == 0, subnormal, normal).astype(np.uint32).view(np.float32)


def fp8_quantize(x, block: int = 128, round_scale: bool = False):
  """Per-token, per-128-channel e4m3 quantisation: returns (q as float32 values, scales);
  `round_scale`: each scale rounded up to a power of two. A NaN is left out of its block's
  amax and stays NaN; an infinite amax gives an infinite scale; `x / scale` saturates at
  +-448."""
  import ml_dtypes
  x = np.asarray(x, np.float32)
  shp = x.shape
  xb = x.reshape(*shp[:-1], shp[-1] // block, block)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    amax = np.fmax.reduce(np.abs(xb), axis=-1, initial=np.float32(0))  # fmax: NaN left out
    scales = np.where(amax > 0, amax * np.float32(1.0 / 448.0), 1.0).astype(np.float32)
    if round_scale:
      scales = _round_up_power_of_two(scales)
    q = np.clip(xb / scales[..., None], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
  return q.reshape(shp), scales


def fp8_dispatch(x, topk_idx, num_experts: int, capacity: int, *, round_scale: bool = False,
                 ue8m0: bool = False, expert_alignment: int = 1):
  """High-throughput dispatch with fp8 rows: each token quantised once (`fp8_quantize`), its
  e4m3 row and its scales placed as `dispatch` places rows. Returns `dispatch`'s list, each
  dict with `recv_x` the e4m3 rows (ml_dtypes float8_e4m3fn) and `scales` `[capacity, H/128]`
  float32 (`[capacity, H/512]` int32 packed exponents with `ue8m0`; zeros in the rows no token
  went to), and `q`, `token_scales`: every token's quantisation `[R, T, H]`, `[R, T, H/128]`."""
  import ml_dtypes
  q, scales = fp8_quantize(x, round_scale=round_scale or ue8m0)
  rows = dispatch(q.astype(np.float32), topk_idx, num_experts, capacity,
                  expert_alignment=expert_alignment)
  placed = dispatch(scales, topk_idx, num_experts, capacity, expert_alignment=expert_alignment)
  for info, s in zip(rows, placed):
    info["recv_x"] = info["recv_x"].astype(ml_dtypes.float8_e4m3fn)
    info["scales"] = pack_ue8m0(s["recv_x"]) if ue8m0 else s["recv_x"]
    info["q"], info["token_scales"] = q, scales
  return rows


# ----------------------------------------------------------------------------------------------
# Routers (numpy, token by token).

def route(logits, num_topk: int, *, score: str = "softmax", renormalize: bool = True,
          bias=None, num_groups: int = 1, topk_groups: int = 1,
          routed_scaling_factor: float = 1.0):
  """`(topk_idx [T, K], topk_weights [T, K], probs [T, E])` of `[T, E]` logits, one token at a
  time: scores, a selection score with the bias, the kept groups, the top-k, the weights."""
  logits = np.asarray(logits, np.float64)
  num_tokens, num_experts = logits.shape
  idx = np.zeros((num_tokens, num_topk), np.int32)
  weights = np.zeros((num_tokens, num_topk))
  probs = np.zeros_like(logits)
  per_group = num_experts // num_groups
  for t in range(num_tokens):
    if score == "softmax":
      e = np.exp(logits[t] - logits[t].max())
      scores = e / e.sum()
      probs[t] = scores
    else:
      scores = 1.0 / (1.0 + np.exp(-logits[t]))
      probs[t] = scores / scores.sum()
    select = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    allowed = list(range(num_experts))
    if num_groups > 1:
      group_scores = [sorted(select[g * per_group:(g + 1) * per_group])[-2:]
                      for g in range(num_groups)]
      ranked = sorted(range(num_groups), key=lambda g: -sum(group_scores[g]))
      kept = set(ranked[:topk_groups])
      allowed = [e for e in range(num_experts) if e // per_group in kept]
    chosen = sorted(allowed, key=lambda e: -select[e])[:num_topk]
    w = np.array([scores[e] for e in chosen])
    if renormalize:
      w = w / w.sum()
    idx[t] = chosen
    weights[t] = w * routed_scaling_factor
  return idx, weights, probs


def load_balancing_loss(probs, topk_idx):
  """`E * sum_e (slots routed to e / all slots) * (mean normalised score of e)`."""
  probs = np.asarray(probs, np.float64)
  num_tokens, num_experts = probs.shape
  counts = np.zeros(num_experts)
  for e in np.asarray(topk_idx).reshape(-1):
    if 0 <= e < num_experts:
      counts[e] += 1
  fraction = counts / max(np.asarray(topk_idx).size, 1)
  return num_experts * float(np.sum(fraction * probs.mean(axis=0)))


def router_z_loss(logits):
  logits = np.asarray(logits, np.float64)
  m = logits.max(axis=-1, keepdims=True)
  lse = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[:, 0]
  return float(np.mean(lse ** 2))


def pack_ue8m0(scales):
  """Power-of-two scales `[..., H/128]` as int32 `[..., H/512]`: byte i of word j is the
  biased exponent byte of channel block 4j + i's float32 scale (`log2(scale) + 127`; 0 for a
  zero or subnormal scale, 255 for an infinite one)."""
  scales = np.asarray(scales, np.float32)
  flat = scales.reshape(-1, scales.shape[-1])
  out = np.zeros((flat.shape[0], scales.shape[-1] // 4), np.uint32)
  exponents = (flat.view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)  # the kernels' byte
  for r in range(flat.shape[0]):
    for b, e in enumerate(exponents[r]):
      out[r, b // 4] |= np.uint32(e) << np.uint32(8 * (b % 4))
  return out.view(np.int32).reshape(*scales.shape[:-1], scales.shape[-1] // 4)
