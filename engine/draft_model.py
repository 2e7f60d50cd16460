"""The draft-model proposer (``--speculative draft --draft-model PATH``): a smaller model with the
target's tokenizer guesses each row's next tokens, the target verifies them.

Per row the draft keeps its own mlx-lm cache (``KVCache``, the compute dtype: never quantized),
made on the row's first ask and caught up then on its prompt and output, in chunks. A step:

    row's tokens   [ ....... cached by the draft ....... | t_a t_b ]   t_b: the row's last token
    catch-up       t_a (and any older pending tokens) run alone, row by row, no head
    draft          [ t_b ] -> d_1, [ d_1 ] -> d_2, ... [ d_{k-1} ] -> d_k   every asking row in one
                   [B, 1] forward a position (the rows' caches merged, left-padded: ``BatchKVCache``)
    afterwards     the cache holds ... t_a t_b d_1 .. d_{k-1}; ``feedback`` trims it to the drafts
                   the target kept, and the next step catches up on the target's own token

A greedy row drafts the draft model's argmax; a sampled row samples from the draft model's
distribution under the row's own logit bias, temperature and filters (``target_logprobs``) and
hands that distribution to the verify (``Draft.probs``), whose rejection sampling keeps the
target's distribution whatever the draft proposes. A draft's randomness comes from a key of the
row's seed and the token's position (independent of the target's key chain), so a seeded request
drafts the same tokens every time it runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, can_trim_prompt_cache, make_prompt_cache

from engine.acceptance import target_logprobs
from engine.loader import LoadedModel, load_model
from engine.model_runner import Forward
from engine.proposers import Ask, Draft
from engine.request import Request, RequestId
from engine.sampler import SamplerState, make_sampler_state

CATCH_UP_CHUNK = 256  # tokens a row's catch-up runs in one forward
_SALT = 0x5EED_D2AF  # keeps a draft's keys apart from the target's key chain of the same seed
_MIX = 0x9E37_79B9_7F4A_7C15


class VocabularyMismatch(ValueError):
    """The draft model does not share the target's tokenizer: its tokens would mean other text."""


def check_same_vocabulary(target_tokenizer: Any, draft_tokenizer: Any, target_size: int, draft_size: int) -> None:
    """Raise ``VocabularyMismatch`` unless both tokenizers map the same strings to the same ids
    and both models' logits have the same width."""
    want, got = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if want != got:
        by_id = {i: s for s, i in want.items()}
        diff = sorted(i for s, i in got.items() if by_id.get(i) != s) + sorted(set(by_id) - set(got.values()))
        first = diff[0]
        raise VocabularyMismatch(
            f"the draft model's tokenizer differs from the target's ({len(diff)} token ids differ; id {first} is "
            f"{_name(got, first)} in the draft, {by_id.get(first, '(none)')!r} in the target): a draft model "
            "needs the target's tokenizer")
    if target_size != draft_size:
        raise VocabularyMismatch(f"the draft model's vocabulary has {draft_size} entries, the target's "
                                 f"{target_size}: a draft model needs the target's vocabulary")


def _name(vocab: dict[str, int], token_id: int) -> str:
    return next((repr(s) for s, i in vocab.items() if i == token_id), "(none)")


def check_draft_folder(target_path: str | Path, draft_path: str | Path) -> None:
    """Before anything loads: ``draft_path`` is a model folder whose tokenizer is the target's
    (``VocabularyMismatch``, ``FileNotFoundError`` otherwise). Reads tokenizers and configs only."""
    from mlx_lm.utils import load_config, load_tokenizer

    folders = [Path(p).expanduser().resolve() for p in (target_path, draft_path)]
    for folder in folders:
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} is not a model folder (no config.json)")
    tokenizers = [load_tokenizer(f) for f in folders]
    sizes = [load_config(f).get("vocab_size") for f in folders]
    check_same_vocabulary(*tokenizers, *sizes)


def draft_key(seed: int, position: int) -> mx.array:
    """The key a row with ``seed`` samples its draft for the token at ``position`` with."""
    return mx.random.key(((seed ^ _SALT) * _MIX + position) % (1 << 64))


@dataclass
class DraftRow:
    """One row's draft state: its cache, the tokens in it (always a prefix of the row's tokens
    once ``feedback`` trimmed the rejected drafts), where its last drafts started, its seed and
    its sampling (the logit bias of ``params``)."""

    layers: list[Any]  # the draft model's cache, one per layer
    seed: int
    sampler: SamplerState
    tokens: list[int] = field(default_factory=list)
    drafted_at: int = 0

    def trim_to(self, n: int) -> None:
        extra = len(self.tokens) - n
        if extra > 0:
            for layer in self.layers:
                layer.trim(extra)
            del self.tokens[n:]


class DraftProposer:
    """Drafts from a smaller model with the target's tokenizer (module docstring). Invariant:
    every row's cache holds exactly ``DraftRow.tokens``."""

    name = "draft"

    def __init__(self, draft: LoadedModel, target: LoadedModel | None = None) -> None:
        if target is not None:
            check_same_vocabulary(target.tokenizer, draft.tokenizer, target.vocab_size, draft.vocab_size)
        if not can_trim_prompt_cache(make_prompt_cache(draft.model)):
            raise ValueError("the draft model's cache cannot drop rejected tokens (a rotating window or "
                             "recurrent layers): it cannot draft")
        self.draft = draft
        self.forward = Forward(draft.model)
        self.rows: dict[RequestId, DraftRow] = {}

    def propose(self, asks: Sequence[Ask]) -> dict[RequestId, Draft]:
        rows = [self._caught_up(ask.request) for ask in asks]
        steps = max(ask.k for ask in asks)
        cache = rows[0].layers if len(rows) == 1 else [BatchKVCache.merge([r.layers[i] for r in rows])
                                                       for i in range(len(rows[0].layers))]
        last = [ask.request.output_ids[-1] for ask in asks]
        inputs = mx.array(last, dtype=mx.int32)[:, None]
        picks, probs = [], []
        for step in range(steps):
            logits = self.draft.model(inputs, cache=cache)[:, -1]
            tokens, q = self._choose(logits, asks, rows, step)
            picks.append(tokens)
            probs.append(q)
            inputs = tokens[:, None]
        drafted = mx.stack(picks, axis=1)
        mx.eval(drafted, [q for qs in probs for q in qs if q is not None])
        if len(rows) > 1:
            for b, row in enumerate(rows):
                row.layers = [layer.extract(b) for layer in cache]
        out = {}
        for b, (ask, row, tokens) in enumerate(zip(asks, rows, drafted.tolist())):
            row.drafted_at = len(row.tokens) + 1  # the row's tokens: what the cache held, then its last
            row.tokens += [last[b], *tokens[: steps - 1]]
            row.trim_to(row.drafted_at + ask.k - 1)  # a shorter ask drafted past its k: not kept
            q = None if ask.request.params.is_greedy else mx.stack([probs[s][b] for s in range(ask.k)])
            out[ask.request.request_id] = Draft(tuple(tokens[: ask.k]), q)
        return out

    def _choose(self, logits: mx.array, asks: Sequence[Ask], rows: list[DraftRow],
                step: int) -> tuple[mx.array, list[mx.array | None]]:
        """Each row's draft at this step [B] (lazy) and, for sampled rows, its distribution [vocab]."""
        logits = logits.astype(mx.float32)
        argmax = mx.argmax(logits, axis=-1).astype(mx.int32)
        tokens, probs = [], []
        for b, (ask, row) in enumerate(zip(asks, rows)):
            params, bias = ask.request.params, row.sampler.bias
            if params.is_greedy:
                biased = argmax[b] if bias is None else mx.argmax(logits[b].at[bias[0]].add(bias[1]), axis=-1)
                tokens.append(biased.astype(mx.int32))
                probs.append(None)
                continue
            logp = target_logprobs(logits[b: b + 1], params, row.sampler)[0]
            logp = logp - mx.logsumexp(logp, axis=-1)  # the filters leave out mass: q sums to 1
            key = draft_key(row.seed, len(row.tokens) + 1 + step)  # the drafted token's position
            tokens.append(mx.random.categorical(logp, key=key).astype(mx.int32))
            probs.append(mx.exp(logp))
        return mx.stack(tokens), probs

    def _caught_up(self, request: Request) -> DraftRow:
        """The row's draft state with every token of the row but its last in the cache."""
        row = self.rows.get(request.request_id)
        if row is None:
            seed = request.params.seed if request.params.seed is not None else int.from_bytes(os.urandom(8), "little")
            row = DraftRow(make_prompt_cache(self.draft.model), seed,
                           make_sampler_state(request.params, self.draft.vocab_size))
            self.rows[request.request_id] = row
        tokens = request.prompt_ids + request.output_ids
        row.trim_to(_common_prefix(row.tokens, tokens))  # drafts whose verify never reported back
        pending = tokens[len(row.tokens): -1]
        for start in range(0, len(pending), CATCH_UP_CHUNK):
            chunk = pending[start: start + CATCH_UP_CHUNK]
            self.forward.hidden(mx.array([chunk], dtype=mx.int32), row.layers)
            mx.eval([c.state for c in row.layers])
            row.tokens += chunk
        return row

    def feedback(self, request_id: RequestId, num_accepted: int) -> None:
        """The target kept ``num_accepted`` of the row's last drafts: the rest leave its cache."""
        row = self.rows.get(request_id)
        if row is not None:
            row.trim_to(row.drafted_at + num_accepted)

    def forget(self, request_id: RequestId) -> None:
        self.rows.pop(request_id, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def load_draft(path: str | Path, target: LoadedModel) -> DraftProposer:
    """The proposer for the draft model folder ``path``, in the target's compute dtype where that
    is a cast of the weights (else as stored); refuses another vocabulary."""
    draft = load_model(path, dtype="auto", model_id=Path(path).name)
    return DraftProposer(draft, target)


def write_layer_subset(src: str | Path, dst: str | Path, layers: Sequence[int]) -> Path:
    """A copy of the mlx-lm model folder ``src`` keeping only the transformer ``layers`` (in that
    order), written to ``dst`` with mlx-lm's own save (weights as stored, quantized or not): a
    cheap draft with the same tokenizer where no smaller trained sibling exists. Returns ``dst``."""
    from mlx_lm.utils import load, save

    model, tokenizer, config = load(str(src), return_config=True)
    body = getattr(model, "model", None)
    if not isinstance(getattr(body, "layers", None), list):
        raise ValueError(f"{src}: not a model whose layers are model.model.layers")
    body.layers = [body.layers[i] for i in layers]
    config["num_hidden_layers"] = len(body.layers)
    save(dst, src, model, tokenizer, config)
    return Path(dst)
