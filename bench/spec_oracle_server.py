"""``kvarn serve`` with a bench-only proposer: the verify path's ceiling for bench/speculative.py.

    python bench/spec_oracle_server.py BOOK.json serve --speculative ngram ...

``BOOK.json`` holds recorded greedy continuations (``[{"prompt": [ids], "output": [ids]}]``);
the proposer drafts a row's next tokens from its prompt's entry, so every draft is accepted
(100% acceptance) wherever the server's greedy tokens equal the recorded ones. Never a product
proposer: it knows the answer.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.proposers import Ask, Draft  # noqa: E402
from engine.request import RequestId  # noqa: E402


class ReplayProposer:
    """Drafts the recorded continuation of each row's prompt."""

    name = "oracle"

    def __init__(self, book: dict[tuple[int, ...], list[int]]) -> None:
        self.book = book

    @classmethod
    def from_entries(cls, entries: list[dict]) -> ReplayProposer:
        """From a book's entries, ``[{"prompt": [ids], "output": [ids]}]``."""
        return cls({tuple(e["prompt"]): e["output"] for e in entries})

    def propose(self, asks: Sequence[Ask]) -> dict[RequestId, Draft]:
        out = {}
        for ask in asks:
            full = self.book.get(tuple(ask.request.prompt_ids), [])
            n = len(ask.request.output_ids)
            tokens = tuple(full[n: n + ask.k])
            if tokens:
                out[ask.request.request_id] = Draft(tokens)
        return out

    def feedback(self, request_id: RequestId, num_accepted: int) -> None:
        """Nothing is kept per row."""

    def forget(self, request_id: RequestId) -> None:
        """Nothing is kept per row."""


def main() -> int:
    proposer = ReplayProposer.from_entries(json.loads(Path(sys.argv[1]).read_text()))
    from server.cli import main as cli

    def with_oracle(config):  # the server's config, its speculation proposing from the book
        if config.engine.speculative is None:
            raise SystemExit("the oracle server needs --speculative ngram (its proposer is replaced)")
        spec = replace(config.engine.speculative, proposer=proposer)
        return replace(config, engine=replace(config.engine, speculative=spec))

    return cli(sys.argv[2:], adjust=with_oracle)


if __name__ == "__main__":
    sys.exit(main())
