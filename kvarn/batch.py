"""Rows of one layer in one forward, each attending its own cache: the generic batch.

Rows in the KVarN pool and in the baselines' slots decode through batches of their own, which
their storage's one decode step runs (``kvarn.paged.PagedBatch``, ``kvarn.slots.SlotBatch``;
``kvarn.rows`` picks). ``BatchRows`` serves every other cache (sliding windows, rotating windows, rows made
outside the engine), and ``ChunkRows`` runs several rows' prompt chunks in one forward. The
batch only points at the rows' caches:

    batch (one layer)   row 0: offset 410
                        row 1: offset 150
                        row 2: offset 4,001

- ``extend`` / ``filter``: rows join and leave between steps; no row's cache is copied;
- ``offset``: per-row RoPE offsets (an int32 array, one per row), which mlx-lm models pass
  to ``mx.fast.rope`` as is;
- ``update_and_fetch``: each row takes its own key/value and commits a tile at its own step;
- attention (the seam, ``kvarn.rows``) runs each row over exactly its own valid tokens: the
  ragged rows need no padding and no validity mask, and a row's scores never see another
  row's tokens. The weight matmuls around it (projections, MLP, LM head) run batched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache


@dataclass(frozen=True)
class RowMasks:
    """One attention mask per row (a model asks the batch cache once, the seam splits it)."""

    masks: tuple[Any, ...]


class BatchRows(_BaseCache):
    """Rows of one layer decoding together. ``row_type`` restricts what may join."""

    row_type: type | tuple[type, ...] = object

    def __init__(self, rows: Iterable[Any] = (), row_type: type | tuple[type, ...] | None = None) -> None:
        if row_type is not None:
            self.row_type = row_type
        self.rows: list[Any] = []
        self.fetched: list[tuple[Any, Any]] = []
        self.extend(rows)

    def extend(self, rows: Iterable[Any]) -> None:
        """Rows join at the end of the batch, as they are."""
        for row in rows:
            if not isinstance(row, self.row_type):
                raise TypeError(f"{type(self).__name__} takes {self.row_type} rows, not {type(row).__name__}")
            self.rows.append(row)

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (indices into the current rows, in the new order)."""
        self.rows = [self.rows[i] for i in keep]
        self.fetched = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def offset(self) -> mx.array:
        return mx.array([row.offset for row in self.rows], dtype=mx.int32)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if keys.shape[0] != len(self.rows):
            raise ValueError(f"{keys.shape[0]} rows of keys for a batch of {len(self.rows)}")
        self.fetched = [row.update_and_fetch(keys[b: b + 1], values[b: b + 1]) for b, row in enumerate(self.rows)]
        return None, None  # nothing to fetch: the storage attends itself (``attend``)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        masks = tuple(row.make_mask(N, return_array=return_array, window_size=window_size) for row in self.rows)
        return None if all(m is None for m in masks) else RowMasks(masks)

    def size(self) -> int:
        return max((row.size() for row in self.rows), default=0)

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.rows)

    @property
    def state(self) -> list[Any]:
        raise NotImplementedError("a batch has no state of its own: save its rows")

    def attend(self, queries: mx.array, keys: Any, values: Any, *, scale: float, mask: Any,
               sinks: mx.array | None, dispatch: Any, default: Any) -> mx.array:
        """Each row over its own cache, through ``dispatch`` (the seam: by the row's own kind)."""
        return batch_attention(dispatch, queries, self, scale, mask, sinks)


class ChunkRows(BatchRows):
    """Prompt chunks of several rows of one layer in one forward, right-padded to the longest:
    row b's chunk is the first ``lengths[b]`` positions of the batch (the rest is padding, never
    written nor attended). ``offset`` is each row's before the chunk (RoPE positions follow from
    it); ``make_mask`` asks each row for its own chunk's mask; each row's attention sees exactly
    the keys its own cache returns (``batch_attention`` pads its output back).

    Rows in shared storage (the baselines' slots) are read back after every row has written:
    a view of the buffers taken between two rows' writes would make MLX copy the whole buffer at
    the next write, where reading the last version lets every write update it in place."""

    def __init__(self, rows: Iterable[Any], lengths: Sequence[int]) -> None:
        super().__init__(rows)
        self.lengths = [int(n) for n in lengths]
        if len(self.lengths) != len(self.rows) or min(self.lengths, default=1) < 1:
            raise ValueError("one chunk length >= 1 per row")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if keys.shape[0] != len(self.rows):
            raise ValueError(f"{keys.shape[0]} rows of keys for a batch of {len(self.rows)}")
        if keys.shape[2] < max(self.lengths):
            raise ValueError(f"{keys.shape[2]} positions for a chunk of {max(self.lengths)} tokens")
        fetched = [row.update_and_fetch(keys[b: b + 1, :, :n], values[b: b + 1, :, :n])
                   for b, (row, n) in enumerate(zip(self.rows, self.lengths))]
        self.fetched = [row.fetch() if hasattr(row, "fetch") else got for row, got in zip(self.rows, fetched)]
        return None, None  # nothing to fetch: the storage attends itself (``attend``)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if N < max(self.lengths):
            raise ValueError(f"a mask of {N} positions for a chunk of {max(self.lengths)} tokens")
        return RowMasks(tuple(row.make_mask(n, return_array=return_array, window_size=window_size)
                              for row, n in zip(self.rows, self.lengths)))

    def filter(self, keep: Sequence[int]) -> None:
        raise NotImplementedError("a chunk batch lives for one forward")


def batch_attention(attend: Any, queries: mx.array, cache: BatchRows, scale: float, mask: Any,
                    sinks: mx.array | None) -> mx.array:
    """Attention of each row over its own cache: ``attend`` is the seam's dispatch (KVarN,
    affine or fp16 per row type); outputs are stacked back into [B, n_q, L, D]."""
    if len(cache.fetched) != len(cache.rows):
        raise RuntimeError("batch attention before update_and_fetch")
    masks = mask.masks if isinstance(mask, RowMasks) else (mask,) * len(cache.rows)
    if isinstance(cache, ChunkRows):  # each row's own positions; its padding attends nothing (zeros)
        L = queries.shape[2]
        outs = []
        for b, (row, n, (keys, values)) in enumerate(zip(cache.rows, cache.lengths, cache.fetched)):
            out = attend(queries[b: b + 1, :, :n], keys, values, row, scale, masks[b], sinks)
            outs.append(out if n == L else mx.pad(out, [(0, 0), (0, 0), (0, L - n), (0, 0)]))
        return mx.concatenate(outs, axis=0)
    outs = [attend(queries[b: b + 1], keys, values, row, scale, masks[b], sinks)
            for b, (row, (keys, values)) in enumerate(zip(cache.rows, cache.fetched))]
    return mx.concatenate(outs, axis=0)
