"""The matchers of constrained rows, and their next-token masks computed on a worker thread.

One matcher per row (each choice of ``n > 1`` its own), made from the request's compiled
``Constraint`` the first time the row samples. A step of the model runner:

    engine thread:  start(masks) --> build + dispatch the step's forward --> wait --> sample --> consume
    mask worker:          [ fill every constrained row's mask (llguidance, no GIL) ]

The mask for a row's next token depends only on the tokens it already sampled (consumed at the
end of the previous step), so it is computed while the model computes the logits it will mask.
Only one job runs at a time and the runner waits for it before the step ends: no matcher is
touched by two threads at once, and a row freed between steps (finished, aborted) is never in
a running job.

A row's step ends one of three ways after its token is consumed: the grammar is complete (the
matcher stopped: ``stop``), the token was refused or the matcher erred (``grammar_dead_end``),
or neither (the row goes on). A mask with no allowed token, or a matcher in error before
sampling, ends the row without a token (``grammar_dead_end``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

from engine.request import FinishReason, Request, RequestId

logger = logging.getLogger(__name__)

DEAD_END = None  # a row's mask entry when no token is allowed (or its matcher erred)


@dataclass
class MaskStats:
    """Mask work since the engine started: masks computed, seconds the worker spent on them, and
    seconds the engine thread waited for them (what the overlap did not hide)."""

    masks: int = 0
    mask_s: float = 0.0
    wait_s: float = 0.0
    consume_s: float = 0.0


class MaskJob:
    """Masks being computed for one step: ``result()`` waits and gives ``{row: allowed}`` where
    ``allowed`` is a bool array over the model's vocabulary, or ``DEAD_END``."""

    def __init__(self, future: Future[dict[RequestId, np.ndarray | None]], stats: MaskStats) -> None:
        self._future, self._stats = future, stats

    def wait(self) -> None:
        """Wait for the job, whatever its outcome (a failed step)."""
        self._future.exception()

    def result(self) -> dict[RequestId, np.ndarray | None]:
        start = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._stats.wait_s += time.perf_counter() - start


class RowGrammars:
    """Matchers by row. Only the engine thread calls it (the worker gets the matchers of one
    job, and the engine waits for the job before touching them again)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.matchers: dict[RequestId, LLMatcher] = {}
        self.widths: dict[RequestId, int] = {}  # each row's mask width: llguidance's vocabulary (>= the model's)
        self.stats = MaskStats()
        self._pool: ThreadPoolExecutor | None = None  # made on first use: unconstrained servers start no thread
        self._executor: LLExecutor | None = None

    def start(self, sampling: Iterable[RequestId], requests: Mapping[RequestId, Request]) -> MaskJob | None:
        """Begin the masks of the rows in ``sampling`` that are constrained (making their
        matchers if they have none yet); None when no row is."""
        rows = []
        for request_id in sampling:
            matcher = self.matchers.get(request_id)
            if matcher is None:
                constraint = requests[request_id].params.constraint
                if constraint is None:
                    continue
                matcher = self.matchers[request_id] = constraint.new_matcher()
                self.widths[request_id] = constraint.mask_vocab
            rows.append((request_id, matcher))
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvarn-masks")
            self._executor = LLExecutor()
        return MaskJob(self._pool.submit(self._fill, rows), self.stats)

    def _fill(self, rows: list[tuple[RequestId, LLMatcher]]) -> dict[RequestId, np.ndarray | None]:
        """The worker: the rows' masks in one llguidance call per mask width (one, unless
        constraints were compiled for different vocabularies), unpacked to bools."""
        start = time.perf_counter()
        masks: dict[RequestId, np.ndarray | None] = {}
        for width in sorted({self.widths[request_id] for request_id, _ in rows}):
            group = [(request_id, m) for request_id, m in rows if self.widths[request_id] == width]
            words = allocate_token_bitmask(len(group), width)
            fill_next_token_bitmask_par(self._executor, [(m, k) for k, (_, m) in enumerate(group)], words)
            allowed = _fit(np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").astype(bool),
                           self.vocab_size)
            for k, (request_id, matcher) in enumerate(group):
                if matcher.is_error() or not allowed[k].any():
                    logger.warning("constrained row %s has no allowed token: %s", request_id,
                                   matcher.get_error() or "empty mask")
                    masks[request_id] = DEAD_END
                else:
                    masks[request_id] = allowed[k]
        self.stats.masks += len(rows)
        self.stats.mask_s += time.perf_counter() - start
        return masks

    def consume(self, request_id: RequestId, token_id: int) -> FinishReason | None:
        """Advance a constrained row's matcher by its sampled token; the row's end, if this
        token ends it (None for unconstrained rows and rows that go on)."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return None
        start = time.perf_counter()
        ok = matcher.consume_token(token_id)
        self.stats.consume_s += time.perf_counter() - start
        if not ok or matcher.is_error():
            logger.warning("constrained row %s: token %d refused: %s", request_id, token_id, matcher.get_error())
            return FinishReason.GRAMMAR_DEAD_END
        return FinishReason.STOP if matcher.is_stopped() else None

    def free(self, request_ids: Iterable[RequestId]) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)
            self.widths.pop(request_id, None)


def _fit(allowed: np.ndarray, vocab_size: int) -> np.ndarray:
    """Masks cut (or padded with False) to the model's logits width."""
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return np.pad(allowed, ((0, 0), (0, vocab_size - allowed.shape[1])))
