"""Speculative verify: rows with drafted tokens check them in one forward, then keep what the
target model accepts.

A verifying row runs its last token and its k drafts as one chunk of k + 1 tokens (several
rows together through ``kvarn.batch.ChunkRows``, right-padded), with logits at every position:

    chunk     [ t_last | d_1 | d_2 | ... | d_k ]      written at the row's offset
    logits      p_0      p_1   p_2         p_k        p_i: the target's next-token distribution
    choice      c_0      c_1   c_2         c_k        (``engine/acceptance.py``)

``c_i`` is ``d_{i+1}`` while drafts are accepted; the first ``c_j`` that differs (a rejection's
replacement, or the bonus token after k accepted drafts) ends the row's tokens for the step: it
gains ``d_1 .. d_j`` and ``c_j``. The storage then drops the k - j rejected tokens it wrote
(``kvarn.rows.end_verify``: KVarN drafts live in the float16 window and a tile commits only once
every token in it is accepted). Greedy rows pick ``c_i = argmax p_i``, so their tokens are the
ones plain decoding picks; sampled rows use speculative rejection sampling, which keeps the
target's distribution.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.acceptance import Choices, choose
from engine.request import Request, RequestId, TokenLogprob
from engine.step_types import SampledToken
from kvarn.batch import ChunkRows
from kvarn.rows import begin_verify, end_verify
from kvarn.step_context import forward_context


@dataclass
class Verifying:
    """One row's verify in flight: its drafts and the lazy choices at every position."""

    drafts: tuple[int, ...]
    choices: Choices

    def arrays(self) -> list[mx.array]:
        return [a for a in vars(self.choices).values() if isinstance(a, mx.array)]


def dispatch_verify(runner: Any, drafts: Mapping[RequestId, tuple[int, ...]],
                    requests: Mapping[RequestId, Request],
                    draft_probs: Mapping[RequestId, mx.array] | None = None) -> dict[RequestId, Verifying]:
    """One forward for every verifying row of the step (``runner``: the ``ModelRunner``, whose
    rows, store and forward it uses), and each row's choices built on its logits (lazy;
    evaluated with the step). ``draft_probs``: a draft model's distributions [k, vocab] per
    row (None: the drafts are deterministic, as prompt lookup's)."""
    ids = list(drafts)
    rows = [runner.rows[i] for i in ids]
    lengths = [1 + len(drafts[i]) for i in ids]
    T = max(lengths)
    tokens = mx.array([[requests[i].output_ids[-1], *drafts[i]] + [0] * (T - n) for i, n in zip(ids, lengths)],
                      dtype=mx.int32)
    for row in rows:
        begin_verify(row.cache)
    if len(rows) == 1:
        cache = rows[0].cache
    else:
        cache = [ChunkRows([row.cache[l] for row in rows], lengths) for l in range(len(rows[0].cache))]
    with forward_context(cache):
        hidden = runner.forward.hidden(tokens, cache)
    logits = runner.forward.all_logits(hidden)
    out = {request_id: verify_choices(logits[b, : lengths[b]], drafts[request_id], row,
                                      draft_probs.get(request_id) if draft_probs else None)
           for b, (request_id, row) in enumerate(zip(ids, rows))}
    if runner.store.in_place:  # settled now, so the decode batch's writes to the shared buffers are in place
        mx.eval([a for v in out.values() for a in v.arrays()], [c.state for row in rows for c in row.cache])
    return out


def verify_choices(logits: mx.array, drafts: tuple[int, ...], row: Any, q: mx.array | None) -> Verifying:
    """A row's verify from its logits at its k + 1 positions [k + 1, V] (a chunk forward's, or
    the decode batch's where the row verified in it: ``ModelRunner._decode_verifying``); ``q``:
    the drafts' distributions [k, V] (None: deterministic drafts)."""
    return Verifying(drafts, choose(logits, drafts, row.params, row.sampler, q))


def collect_verify(runner: Any, verifying: Mapping[RequestId, Verifying]) -> dict[RequestId, list[SampledToken]]:
    """Each verified row's tokens for the step (accepted drafts, then the one that ended it),
    read back once the step is evaluated; the rows drop their rejected tokens. A row freed
    meanwhile (aborted) is skipped: its storage went back with it."""
    out: dict[RequestId, list[SampledToken]] = {}
    commits = []
    for request_id, v in verifying.items():
        row = runner.rows.get(request_id)
        if row is None:
            continue
        chosen = v.choices.tokens.tolist()
        j = next((i for i, d in enumerate(v.drafts) if chosen[i] != d), len(v.drafts))
        end_verify(row.cache, len(v.drafts) - j)
        if v.choices.keys is not None:  # the row's key chain moves on by the tokens it keeps
            row.sampler.key = v.choices.keys[j + 1]
        commits += [c.state for c in row.cache]
        runner.store.settle(row.cache)
        out[request_id] = [SampledToken(request_id, token, _logprob(v.choices, i, token))
                           for i, token in enumerate(chosen[: j + 1])]
    if commits:
        mx.eval(commits)  # a committed tile is written before the next step reads the pool
    return out


def _logprob(choices: Choices, i: int, token: int) -> TokenLogprob | None:
    if choices.logprobs is None:
        return None
    top: tuple[tuple[int, float], ...] = ()
    if choices.top_ids is not None:
        pairs = zip(choices.top_ids[i].tolist(), choices.top_logprobs[i].tolist())
        top = tuple(sorted(pairs, key=lambda p: -p[1]))
    return TokenLogprob(token, choices.logprobs[i].item(), top)
