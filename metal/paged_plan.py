"""The split plan of the paged decode attention: every decoding row's tiles cut into work items,
one block (CUDA) or threadgroup (Metal) per work item and KV head. Shared by the CUDA bodies
(``metal.cuda.paged_decode``) and the Metal twin (``metal.msl.paged_decode``); made once a step and
shared by its layers.

A row's tiles, in sequence order, and how the work list cuts them into splits::

    tile  0      1 .. nt                 nt+1 (only if tail_len > 0)
          sink | record table[b][0] ... | tail
          win[slot, :, 0:sink_len]       win[slot, :, G:G+tail_len]
    work item = (row b, first tile, end tile); one block per (work item, KV head)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from metal.device import planning_sms

BLOCKS_PER_SM = 3  # the tensor-core body's resident blocks (58.7 KB of shared memory each at k4v2): one wave of splits
SCALAR_BLOCKS_PER_SM = 16  # the scalar body's split target (measured on the H200: 4 left the multiprocessors idle)
# one work item a row (one launch, no combine) only when rows x KV heads fill a wave of BLOCKS_PER_SM blocks a
# multiprocessor; fewer rows are split, however short. In isolation (bench/kernel_decode.py, its K/V re-read from
# the L2 cache) one item a row looked faster up to 64 tiles, but inside the engine's step, K/V streamed from HBM,
# one row at 4k decoded in 11.1 ms a step split against 12.5 ms as one item, at 1k 10.2 against 10.6 (H100, 8B
# shape): 8 blocks streaming a row each leave the GPU waiting (docs/benchmarks.md, "Kernels").


@dataclass(frozen=True)
class RowLengths:
    """Per-row host ints of one decode step: window ``slots``, ``sink_len`` (<= G), ``tail_len``
    (< G) and ``num_tiles`` (records); row b attends sink_len + num_tiles*G + tail_len tokens."""

    slots: tuple[int, ...]
    sink_len: tuple[int, ...]
    tail_len: tuple[int, ...]
    num_tiles: tuple[int, ...]


@dataclass(frozen=True)
class DecodePlan:
    """One step's split of every row's tiles into work items (host lists and their device arrays).

    ``work`` [num_items, 3]: (row, first tile, end tile); ``row_work`` [B + 1]: row b's items are
    ``row_work[b]:row_work[b+1]``; ``rows`` [B, 4]: (window slot, sink_len, tail_len, num_tiles)."""

    work: mx.array
    row_work: mx.array
    rows: mx.array
    num_items: int
    memo: dict = field(default_factory=dict, compare=False)  # the scalar body's own plan, made once


def plan_splits(num_tiles: Sequence[int], tail_len: Sequence[int], n_kv_heads: int,
                num_sms: int | None = None, blocks_per_sm: int = BLOCKS_PER_SM,
                min_split: int = 1, single: bool | None = None) -> list[tuple[int, int, int]]:
    """Cut each row's tiles (sink, records, tail if non-empty) into work items.

    ``num_sms``: the multiprocessors to fill (None: the device's, ``metal.device.planning_sms``).
    ``single`` (None: when rows x KV heads >= BLOCKS_PER_SM x num_sms): one item a row, so the
    attention launch writes the output itself.
    Else splits of about the same size: the batch's tiles over about blocks_per_sm x num_sms blocks,
    so one long row, many short rows and a mix all fill the GPU; a row gets round(its tiles / split
    size) splits, at least one (splits of at least ``min_split`` tiles)."""
    num_sms = planning_sms(num_sms)
    counts = [1 + n + (t > 0) for n, t in zip(num_tiles, tail_len)]
    if single is None:
        blocks = len(counts) * n_kv_heads
        single = blocks >= BLOCKS_PER_SM * num_sms
    if single:
        return [(b, 0, c) for b, c in enumerate(counts)]
    target_items = max(1, (blocks_per_sm * num_sms) // max(1, n_kv_heads))
    per_split = max(1, min_split, math.ceil(sum(counts) / target_items))
    work = []
    for b, count in enumerate(counts):
        n = max(1, min(count, round(count / per_split)))
        edges = [count * i // n for i in range(n + 1)]
        work.extend((b, lo, hi) for lo, hi in zip(edges, edges[1:]))
    return work


def make_plan(slots: Sequence[int], sink_len: Sequence[int], tail_len: Sequence[int],
              num_tiles: Sequence[int], n_kv_heads: int, **policy) -> DecodePlan:
    """The step's plan (``plan_splits``'s keywords pass through)."""
    work = plan_splits(num_tiles, tail_len, n_kv_heads, **policy)
    row_work = [0] * (len(slots) + 1)
    for b, _, _ in work:
        row_work[b + 1] += 1
    for b in range(len(slots)):
        row_work[b + 1] += row_work[b]
    i32 = mx.int32
    return DecodePlan(work=mx.array(work, dtype=i32).reshape(-1, 3), row_work=mx.array(row_work, dtype=i32),
                      rows=mx.array(list(zip(slots, sink_len, tail_len, num_tiles)), dtype=i32).reshape(-1, 4),
                      num_items=len(work))


def static_splits(rows: int, table_width: int, n_kv_heads: int, num_sms: int | None = None) -> int:
    """Work items a row for a step whose shapes are fixed ahead (a compiled decode step: ``rows``
    rows padded to a bucket, block tables ``table_width`` wide), decided from those shapes only:
    one a row where rows x KV heads fill a wave (as ``plan_splits``), else enough for about a wave
    of blocks, at most a row's widest tile count."""
    num_sms = planning_sms(num_sms)
    tiles = table_width + 2  # the sink, the records, the tail
    if rows * n_kv_heads >= BLOCKS_PER_SM * num_sms:
        return 1
    return max(1, min(tiles, (BLOCKS_PER_SM * num_sms // max(1, n_kv_heads)) // max(1, rows)))


def static_plan(slots: Sequence[int], sink_len: Sequence[int], tail_len: Sequence[int],
                num_tiles: Sequence[int], splits: int) -> tuple[mx.array, mx.array, mx.array]:
    """(work, row_work, rows) arrays of a plan with exactly ``splits`` work items a row (some may be
    empty: a row with fewer tiles than splits; an empty item's partial has no weight in the
    combine), so the launch's grid depends on the shapes only and a compiled step replays it."""
    work, row_work = [], [0]
    for b, (n, t) in enumerate(zip(num_tiles, tail_len)):
        count = 1 + n + (t > 0)
        used = min(splits, count)
        edges = [count * i // used for i in range(used + 1)]
        work.extend((b, lo, hi) for lo, hi in zip(edges, edges[1:]))
        # an empty item is (b, 1, 1): the kernels take the sink with any item starting at tile 0 and
        # the tail with any item ending at the last tile, so an empty one must do neither
        work.extend((b, 1, 1) for _ in range(splits - used))
        row_work.append(row_work[-1] + splits)
    i32 = mx.int32
    return (mx.array(work, dtype=i32).reshape(-1, 3), mx.array(row_work, dtype=i32),
            mx.array(list(zip(slots, sink_len, tail_len, num_tiles)), dtype=i32).reshape(-1, 4))
