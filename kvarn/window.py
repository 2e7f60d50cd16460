"""Attention windows of KVarN rows (``--max-kv-size N``): which records a token attends (a prompt
chunk's attention applies the rule per token in its mask: ``kvarn.attention.chunk_attention_over``).

A windowed row keeps its sink (the first G tokens, float16), the newest whole records and its
float16 tail, such that everything a token attends fits in N tokens; records older than that
are dropped from the row's block table whole (``kvarn.paged.PagedRow.evict``), so a row holds at
most ``(N - G) // G`` record blocks however long it runs. RoPE positions stay the true ones.

    N = 4G, a row at 9G + 5 tokens (the newest token attends 3G + 5 <= N of them):

    tile      0      1  2  3  4  5  6  7   8   9
    tokens   [sink ][..evicted: gone.....][r6][r7][tail 5]
    table              (dropped, decref'd) [b6  b7]            first = 6 (records 0..5 evicted)

For a token that is the ``n``-th of the row (it sees itself: ``n = position + 1``) with ``t``
of them in the tail (its own tile in float16: ``t = 0`` when the token completed a tile, which
it then sees as a record) and ``c`` records committed, the newest ``k = (N - G - t) // G``
records are kept: records ``[c - k, c)`` (``evicted_records``). That index never decreases as
the row grows, so a record dropped for one token is never needed by a later one, and every
token sees the view decode would show it, whether it came in a prompt chunk or in decode: a
prompt longer than N is attended window by window, exactly as decoding it would.
"""

from __future__ import annotations


def committed_records(num_tokens: int, G: int) -> int:
    """Records a row of ``num_tokens`` tokens has committed (full tiles after the sink)."""
    return max(0, num_tokens - G) // G


def evicted_records(num_tokens: int, window: int | None, G: int) -> int:
    """Records a windowed row no longer attends once it holds ``num_tokens`` tokens: the
    newest token sees the sink, records ``[evicted, committed)`` and its tail, at most
    ``window`` tokens. 0 without a window or while the row fits in it."""
    if window is None or num_tokens <= window:
        return 0
    c = committed_records(num_tokens, G)
    tail = (num_tokens - G) % G if num_tokens > G else 0
    keep = max(0, (window - G - tail) // G)
    return max(0, c - keep)
