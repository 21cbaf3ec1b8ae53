"""Where the groups' rows are: the one place that turns `group_sizes` (and `group_offsets`)
into row bounds, row masks, the kernels' work list and the folds `jax.vmap` takes.

A layout is `[G]` sizes and `[G]` offsets: group g is rows `[offsets[g], offsets[g] +
sizes[g])`, ascending and disjoint; rows between and past the groups are padding. Without
offsets the groups follow each other from row 0 (`contiguous_offsets`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def contiguous_offsets(group_sizes) -> jax.Array:
  """`[..., G]` int32: where each group starts when the groups follow each other from row 0
  (the exclusive cumulative sum of `group_sizes`)."""
  sizes = jnp.asarray(group_sizes).astype(jnp.int32)
  return jnp.cumsum(sizes, axis=-1, dtype=jnp.int32) - sizes


def group_bounds(group_sizes, group_offsets=None):
  """`(starts, ends)` `[G]` int32: group g is rows `[starts[g], ends[g])`."""
  sizes = group_sizes.astype(jnp.int32)
  starts = contiguous_offsets(sizes) if group_offsets is None else group_offsets.astype(jnp.int32)
  return starts, starts + sizes


def group_blocks(starts, ends, block: int):
  """Per group: its first row block and number of row blocks of `block` rows (`[G]` int32
  each; no blocks for an empty group)."""
  first = starts // block
  count = jnp.where(ends > starts, (ends - 1) // block - first + 1, 0)
  return first, count


def rows_inside_groups(group_sizes, group_offsets, num_rows: int) -> jax.Array:
  """`[..., num_rows]` bool: rows inside some group (`[offset, offset + size)`; the groups do
  not overlap), for `group_sizes` and `group_offsets` `[..., L]`."""
  if group_sizes.ndim > 1:
    return jax.vmap(lambda s, o: rows_inside_groups(s, o, num_rows))(group_sizes, group_offsets)
  starts, ends = group_bounds(group_sizes, group_offsets)
  # +1 where a group starts, -1 where it ends: the running sum is 1 inside a group, else 0.
  delta = jnp.zeros((num_rows + 1,), jnp.int32)
  delta = delta.at[starts].add(1, mode="drop").at[ends].add(-1, mode="drop")
  return jnp.cumsum(delta)[:num_rows] > 0


def blocks_inside_groups(group_sizes, group_offsets, num_rows: int, block: int) -> jax.Array:
  """`[cdiv(num_rows, block)]` bool: the blocks of `block` rows that hold a row inside some
  group."""
  starts, ends = group_bounds(group_sizes, group_offsets)
  first, count = group_blocks(starts, ends, block)
  used = (count > 0).astype(jnp.int32)
  delta = jnp.zeros((cdiv(num_rows, block) + 1,), jnp.int32)
  delta = delta.at[first].add(used, mode="drop").at[first + count].add(-used, mode="drop")
  return jnp.cumsum(delta)[:-1] > 0


def rows_below_count(count, num_rows: int) -> jax.Array:
  """`[L, num_rows, 1]` bool: the first `count[l]` rows of each slab `l` (the low-latency
  layout: one group per slab, from its row 0)."""
  return jnp.arange(num_rows, dtype=jnp.int32)[None, :, None] < count[:, None, None]


def spans(rows: int, group_sizes, group_offsets):
  """`[G]` sizes that give each group the rows from its start to the next group's start (the
  first also the rows before it): `lax.ragged_dot`'s contiguous groups over a layout with gaps.
  A gap's rows are multiplied by the group before it: unspecified rows, like the gap."""
  starts = group_offsets
  out = jnp.concatenate([starts[1:] - starts[:-1], group_sizes[-1:]])
  return out.at[0].add(starts[0])


def owner(ends, i):
  """`[N]` int32: for each index `i` the group whose entries hold it, given each group's
  cumulative end `ends` `[G]` (a group of none holds none); the last group past the end.
  NOTES: a comparison against every group's end, not jnp.searchsorted: its default method is a
  while loop, whose every step costs a launch and a host round trip on GPUs."""
  return jnp.minimum(jnp.sum(ends[None, :] <= i[:, None], axis=1, dtype=jnp.int32),
                     ends.shape[0] - 1)


def row_tiles(group_sizes, rows: int, block_m: int, group_offsets=None):
  """The Hopper kernels' work list: items in row order, one per (row tile, group) pair holding
  rows of it.

  Args:
    group_sizes: `[G]` int32; the groups end at most at row `rows`.
    rows: the static row count. block_m: the row tile.
    group_offsets: `[G]` int32 first row of each group, ascending (rows between groups are
      padding: no item covers them); default: the groups follow each other from row 0.

  Returns:
    `(tile, group, first, count, num_items)`: `[max_items]` int32 each, with
    `max_items = cdiv(rows, block_m) + G - 1` (each group boundary splits at most one tile):
    item i covers rows `tile[i] * block_m + [first[i], first[i] + count[i])` of group
    `group[i]`; items `>= num_items` (`[1]` int32) are unused (zeros).
  """
  groups = group_sizes.shape[0]
  max_items = cdiv(rows, block_m) + groups - 1
  starts, ends = group_bounds(group_sizes, group_offsets)
  first_tile, tiles_of = group_blocks(starts, ends, block_m)
  item_end = jnp.cumsum(tiles_of)
  num_items = item_end[-1]
  i = jnp.arange(max_items, dtype=jnp.int32)
  group = owner(item_end, i)
  tile = first_tile[group] + i - (item_end[group] - tiles_of[group])
  lo = jnp.maximum(starts[group], tile * block_m)
  hi = jnp.minimum(ends[group], (tile + 1) * block_m)
  used = i < num_items
  zero = jnp.zeros((), jnp.int32)
  return (jnp.where(used, tile, zero), jnp.where(used, group, zero),
          jnp.where(used, lo - tile * block_m, zero), jnp.where(used, hi - lo, zero),
          num_items.reshape(1).astype(jnp.int32))


def group_steps(first, count, max_steps: int):
  """The steps of a weight gradient whose reduction runs from one group into the next: group
  g's row blocks `first[g] .. first[g] + count[g] - 1`, the groups one after another (a group
  of no blocks has no step: its result is its accumulator's zeros).

  Args:
    first, count: `[G]` int32, each group's first row block and number of blocks
      (`group_blocks`, or `aligned_blocks`' last two).
    max_steps: at least the steps of all groups (`cdiv(rows, block) + G` bounds
      `group_blocks`': a block is counted once more for each group boundary inside it): the
      table's static length.

  Returns:
    `(block, group_first)`: per step (`[max_steps]` int32) its row block (0 past the last);
    per group (`[G + 1]` int32) its first step, then the number of steps.
  """
  step_end = jnp.cumsum(count, dtype=jnp.int32)
  step_start = step_end - count
  i = jnp.arange(max_steps, dtype=jnp.int32)
  group = owner(step_end, i)
  block = jnp.where(i < step_end[-1], first[group] + i - step_start[group], 0)
  return block.astype(jnp.int32), jnp.concatenate([step_start, step_end[-1:]]).astype(jnp.int32)


def aligned_blocks(group_sizes, group_offsets, rows: int, block: int):
  """A copy of the rows in which each group starts at a multiple of `block` (its last block
  padded with zeros): where the FP8 weight gradient's operands, quantised per `block` rows
  along the tokens, put them, so that no block holds two groups' rows.

  Args:
    group_sizes, group_offsets: `[G]` int32 (offsets None: the groups follow each other).
    rows: the static row count of the source. block: the rows of a block.

  Returns:
    `(src, count, first, blocks)`: per block of the copy (`[NB]` int32, `NB = cdiv(rows,
    block) + G + 1`: each group adds at most one partial block, and the last block is all
    zeros) the source row it starts at and its rows (`0..block`: the block's rows past
    `count` are zeros, a block past the groups' has none); per group (`[G]` int32) its first
    block and number of blocks. An empty group has the last, all-zero block as its one.
  """
  groups = group_sizes.shape[0]
  num_blocks = cdiv(rows, block) + groups + 1
  starts, ends = group_bounds(group_sizes, group_offsets)
  blocks = (ends - starts + block - 1) // block
  block_end = jnp.cumsum(blocks)
  first = block_end - blocks
  b = jnp.arange(num_blocks, dtype=jnp.int32)
  group = owner(block_end, b)
  src = starts[group] + (b - first[group]) * block
  count = jnp.where(b < block_end[-1], jnp.clip(ends[group] - src, 0, block), 0)
  empty = blocks == 0
  return (jnp.where(count > 0, src, 0).astype(jnp.int32), count.astype(jnp.int32),
          jnp.where(empty, num_blocks - 1, first).astype(jnp.int32),
          jnp.where(empty, 1, blocks).astype(jnp.int32))


def copy_aligned(a, src, count, block: int):
  """`a` `[rows, C]` copied into `aligned_blocks`' layout: `[NB * block, C]`, block b the
  `count[b]` rows from row `src[b]`, then zeros (whatever the rows outside the groups held)."""
  offsets = jnp.arange(block, dtype=jnp.int32)
  rows = jnp.clip(src[:, None] + offsets[None, :], 0, a.shape[0] - 1).reshape(-1)
  keep = (offsets[None, :] < count[:, None]).reshape(-1, 1)
  return jnp.where(keep, a[rows], jnp.zeros((), a.dtype))


# ----------------------------------------------------------------------------------------------
# vmap: the batch folded into rows and groups, one call.

def fold_rows_by_group(group_sizes, group_offsets, rows):
  """For `[B, G]` groups over `[B, rows]` rows: `(pos [B, rows], sizes [G])` where row r of
  batch b goes to `pos[b, r]` of a `[B * rows]` layout whose group g holds every batch's rows of
  g (batches in order), followed by every row outside the groups."""
  starts = group_offsets
  ends = starts + group_sizes  # [B, G]
  r = jnp.arange(rows, dtype=jnp.int32)
  groups = group_sizes.shape[1]
  # The last group starting at or before the row (groups are ascending and disjoint; an empty
  # group sharing a start with the next loses the tie). Comparisons, not jnp.searchsorted (a
  # while loop: a launch and host round trip per step).
  group = jnp.sum(starts[:, None, :] <= r[None, :, None], axis=2, dtype=jnp.int32) - 1
  g = jnp.clip(group, 0, groups - 1)
  inside = (group >= 0) & (r[None, :] < jnp.take_along_axis(ends, g, axis=1))
  totals = jnp.sum(group_sizes, axis=0)  # [G]
  group_start = contiguous_offsets(totals)
  before = contiguous_offsets(group_sizes.T).T  # [B, G]: earlier batches' rows of g
  within = r[None, :] - jnp.take_along_axis(starts, g, axis=1)
  pos_inside = group_start[g] + jnp.take_along_axis(before, g, axis=1) + within
  outside = ~inside
  tails = jnp.sum(outside, axis=1, dtype=jnp.int32)  # [B]
  tail_start = jnp.sum(totals) + contiguous_offsets(tails)  # [B]
  pos_tail = tail_start[:, None] + jnp.cumsum(outside, axis=1, dtype=jnp.int32) - 1
  return jnp.where(inside, pos_inside, pos_tail).astype(jnp.int32), totals.astype(jnp.int32)


def inverse_permutation(pos):
  flat = pos.reshape(-1)
  return jnp.zeros_like(flat).at[flat].set(jnp.arange(flat.shape[0], dtype=flat.dtype),
                                           unique_indices=True)


def flat_groups(group_sizes, group_offsets, rows):
  """`[B, G]` groups over `[B, rows]` rows as `[B * G]` groups over `B * rows` rows."""
  batch = group_sizes.shape[0]
  shift = (jnp.arange(batch, dtype=jnp.int32) * rows)[:, None]
  return group_sizes.reshape(-1), (group_offsets + shift).reshape(-1)
