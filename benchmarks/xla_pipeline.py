"""The plain-XLA expert-parallel baseline: the best dispatch and combine we can write with
`jax.lax.ragged_all_to_all` and no custom kernels.

Dispatch: sort the slots by expert (so by destination rank), exchange the counts, one ragged
all-to-all for the rows and one for their local expert ids, then a local permute that groups the
received rows by local expert. Combine undoes each step: inverse local permute, ragged all-to-all
back to the senders, inverse sort, fp32 weighted sum over the K slots. One row per slot (a plain
ragged all-to-all cannot deduplicate a token sent to several experts of one rank), which is also
the contract's receive layout, so the grouped rows equal the contract's `recv_x` rows.

Runs inside `shard_map` over the EP axis (per-shard arrays). Preconditions (the benchmark's
routing meets them): expert ids lie in `[0, E)` (`bincount` would file a -1 under rank 0), and
`capacity` holds every row a rank receives (the collective does not count overflow). `ragged` can
be swapped for an emulation where XLA lacks the collective (`jax.lax.ragged_all_to_all` is not
implemented on XLA:CPU). Permutations are undone with gathers through inverse permutations
(int32 scatters), not by scattering rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PipelineState(NamedTuple):
  """What combine needs from dispatch (per rank)."""
  order: jax.Array           # [T*K] slots sorted by expert (stable)
  send_sizes: jax.Array      # [R] rows sent to each rank
  input_offsets: jax.Array   # [R] where each destination's rows start in the sorted rows
  recv_sizes: jax.Array      # [R] rows received from each rank
  recv_offsets: jax.Array    # [R] where each source's rows start in the receive buffer
  return_offsets: jax.Array  # [R] where this rank's rows start in each source's sorted rows
  local_order: jax.Array     # [C] receive-buffer rows grouped by local expert (stable)
  inverse_order: jax.Array   # [T*K] position of each slot among the sorted rows
  inverse_local: jax.Array   # [C] position of each receive-buffer row among the grouped rows


def _exclusive_cumsum(v):
  return jnp.cumsum(v) - v


def _inverse(permutation):
  n = permutation.shape[0]
  return jnp.zeros((n,), jnp.int32).at[permutation].set(jnp.arange(n, dtype=jnp.int32),
                                                        unique_indices=True)


def dispatch(x, topk_idx, *, axis: str, num_ranks: int, num_experts: int,
             capacity: int | None = None, ragged=jax.lax.ragged_all_to_all):
  """Returns `(grouped [C, H], group_sizes [L], state)`; rows past sum(group_sizes) are padding.

  `capacity` (C) defaults to every slot of every rank, `R * T * K`, which never overflows.
  """
  num_tokens, num_topk = topk_idx.shape
  num_local = num_experts // num_ranks
  if capacity is None:
    capacity = num_ranks * num_tokens * num_topk
  flat = topk_idx.reshape(-1).astype(jnp.int32)
  order = jnp.argsort(flat, stable=True)
  sorted_experts = flat[order]
  rows = jnp.take(x, order // num_topk, axis=0)
  send_sizes = jnp.bincount(sorted_experts // num_local, length=num_ranks).astype(jnp.int32)
  input_offsets = _exclusive_cumsum(send_sizes)
  recv_sizes = jax.lax.all_to_all(send_sizes, axis, 0, 0, tiled=True)
  recv_offsets = _exclusive_cumsum(recv_sizes)
  # Each sender writes where the receiver expects this source: the receiver's recv_offsets.
  output_offsets = jax.lax.all_to_all(recv_offsets, axis, 0, 0, tiled=True)
  received = ragged(rows, jnp.zeros((capacity, x.shape[1]), x.dtype), input_offsets, send_sizes,
                    output_offsets, recv_sizes, axis_name=axis)
  # The local expert of each received row travels alongside (padding rows keep id L: last).
  local_ids = ragged((sorted_experts % num_local)[:, None],
                     jnp.full((capacity, 1), num_local, jnp.int32), input_offsets, send_sizes,
                     output_offsets, recv_sizes, axis_name=axis)[:, 0]
  local_order = jnp.argsort(local_ids, stable=True)
  grouped = jnp.take(received, local_order, axis=0)
  group_sizes = jnp.bincount(local_ids, length=num_local).astype(jnp.int32)
  return_offsets = jax.lax.all_to_all(input_offsets, axis, 0, 0, tiled=True)
  state = PipelineState(order, send_sizes, input_offsets, recv_sizes, recv_offsets,
                        return_offsets, local_order, _inverse(order), _inverse(local_order))
  return grouped, group_sizes, state


def combine(expert_out, topk_weights, state: PipelineState, *, axis: str,
            ragged=jax.lax.ragged_all_to_all):
  """`out[t] = sum_k w[t, k] * expert_out[row of slot (t, k)]` in fp32, in `expert_out`'s dtype."""
  num_tokens, num_topk = topk_weights.shape
  hidden = expert_out.shape[1]
  received = jnp.take(expert_out, state.inverse_local, axis=0)
  # Back to the senders: my chunk from source s returns to s's sorted rows at the offset where
  # s's rows for me started.
  back = ragged(received, jnp.zeros((num_tokens * num_topk, hidden), expert_out.dtype),
                state.recv_offsets, state.recv_sizes, state.return_offsets, state.send_sizes,
                axis_name=axis)
  slots = jnp.take(back, state.inverse_order, axis=0)
  out = jnp.einsum("tkh,tk->th", slots.reshape(num_tokens, num_topk, hidden).astype(jnp.float32),
                   topk_weights.astype(jnp.float32))
  return out.astype(expert_out.dtype)


def split_updates(ragged, pieces: int):
  """`ragged` with each peer's slice cut into `pieces` contiguous updates (`R * pieces` in all).

  Same result; the point is speed. XLA's one-shot ragged all-to-all kernel gives each update its
  own thread blocks, so one update per peer moves a whole peer's rows with a handful of SMs
  (JAX 0.11.2 on 2 x H200, one process: 87 ms for what NVLink moves in 0.3 ms). The cut is a
  function of the slice size alone, so a sender's pieces of `send_sizes[d]` and receiver d's
  pieces of the equal `recv_sizes[s]` agree without exchanging anything.
  """
  if pieces == 1:
    return ragged

  def cut(offsets, sizes):
    # Piece j of a slice of n rows: n // pieces rows, one more for the first n % pieces pieces.
    j = jnp.arange(pieces, dtype=sizes.dtype)
    base, extra = (sizes // pieces)[:, None], (sizes % pieces)[:, None]
    piece_sizes = base + (j < extra).astype(sizes.dtype)
    piece_offsets = offsets[:, None] + j * base + jnp.minimum(j, extra)
    return piece_offsets.reshape(-1), piece_sizes.reshape(-1)

  def split(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, **kw):
    input_offsets, piece_send = cut(input_offsets, send_sizes)
    output_offsets, _ = cut(output_offsets, send_sizes)
    _, piece_recv = cut(jnp.zeros_like(recv_sizes), recv_sizes)
    return ragged(operand, output, input_offsets, piece_send, output_offsets, piece_recv, **kw)
  return split


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name: str, num_ranks: int):
  """`jax.lax.ragged_all_to_all` from `all_to_all` on padded blocks (for XLA:CPU tests); any
  number of updates per peer, as the real collective (update i goes to rank i // per_peer)."""
  max_rows = operand.shape[0]
  per_peer = input_offsets.shape[0] // num_ranks
  padded = jnp.concatenate([operand, jnp.zeros_like(operand)], axis=0)  # slices never clamp
  blocks = jnp.stack([jax.lax.dynamic_slice_in_dim(padded, input_offsets[i], max_rows)
                      for i in range(num_ranks * per_peer)])
  blocks = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # [i]: update i // per_peer
  where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # from rank i // per_peer
  rows = jnp.arange(max_rows)
  for i in range(num_ranks * per_peer):
    target = jnp.where(rows < recv_sizes[i], where[i] + rows, output.shape[0])  # past end: drop
    output = output.at[target].set(blocks[i], mode="drop")
  return output
