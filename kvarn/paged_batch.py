"""A decode batch of paged KVarN rows (``kvarn.paged``): one graph per layer for all of them.

A decode step writes every row's token and commits every tile that fills (``kvarn.paged_step``),
then attends every row over its window (one slice: the batch's windows are kept consecutive in
batch order) and its records under a per-row validity mask made once per step (``StepIndex``;
``kvarn.paged_attention``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import mlx.core as mx

from kvarn.batch import BatchRows
from kvarn.paged import PagedLayer
from kvarn.paged_attention import decode_attention
from kvarn.paged_step import StepIndex, decode_update, step_index


class PagedBatch(BatchRows):
    """Layer ``l`` of the rows decoding together: one graph for all of them (``attend``, never
    row by row). Rows join (``extend``) and leave (``filter``) between
    steps; nothing of theirs is copied."""

    row_type = PagedLayer

    def __init__(self, rows: Iterable[PagedLayer] = ()) -> None:
        self.index: StepIndex | None = None
        super().__init__(rows)

    def extend(self, rows: Iterable[PagedLayer]) -> None:
        rows = list(rows)
        for row in rows:
            if not isinstance(row, PagedLayer):
                raise TypeError(f"PagedBatch takes PagedLayer rows, not {type(row).__name__}")
        anchor = (self.rows or rows)[:1]
        if anchor and any(r.row.pool is not anchor[0].row.pool or r.l != anchor[0].l for r in rows):
            raise ValueError("a paged batch holds one layer of one pool")
        super().extend(rows)

    def filter(self, keep: Sequence[int]) -> None:
        super().filter(keep)
        self.index = None

    @property
    def offset(self) -> mx.array:
        return step_index(self.rows).offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if keys.shape[0] != len(self.rows) or keys.shape[2] != 1:
            raise ValueError(f"a paged batch of {len(self.rows)} rows takes [B, H, 1, D] keys, not {keys.shape}")
        self.index = decode_update(self.rows, keys, values)
        return None, None  # nothing to fetch: the storage attends itself (``attend``)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return None  # the validity mask is the step index's

    def attend(self, queries: mx.array, keys: Any, values: Any, *, scale: float, mask: Any,
               sinks: mx.array | None, dispatch: Any, default: Any) -> mx.array:
        """Every row's decode attention in one graph (``kvarn.paged_attention``)."""
        if sinks is not None:
            raise ValueError("KVarN attention does not support attention sinks")
        if self.index is None:
            raise RuntimeError("paged batch attention before update_and_fetch")
        return decode_attention(queries, self.rows, self.index, scale)


def paged_attention(queries: mx.array, cache: PagedLayer | PagedBatch, scale: float, mask: Any) -> mx.array:
    """A paged cache's attention (one row's chunk or token, or a whole decode batch) after its
    ``update_and_fetch``, as the seam runs it inside a model's forward."""
    return cache.attend(queries, cache, cache, scale=scale, mask=mask, sinks=None, dispatch=None, default=None)
