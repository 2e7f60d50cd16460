"""Stop strings and EOS on real tokens: found across token boundaries, never emitted."""

import pytest

from engine.output import OutputState, _held_back_len, advance, new_text_stream
from engine.request import FinishReason, Request, RequestId, SamplingParams

TEXT = "It is used to list directory contents, sorted by name."


def feed(loaded, text: str, stop: tuple[str, ...], max_tokens: int = 100, extra: list[int] = ()):
    ids = list(loaded.tokenizer.encode(text, add_special_tokens=False)) + list(extra)
    request = Request(RequestId("r"), [1, 2, 3], SamplingParams(max_tokens=max_tokens, stop=stop))
    state = OutputState(new_text_stream(loaded.tokenizer), stop)
    emitted, finish, count = "", None, 0
    for token in ids:
        request.output_ids.append(token)
        delta = advance(state, request, token, None, frozenset(loaded.tokenizer.eos_token_ids), 4096)
        emitted += delta.text
        count += len(delta.token_ids)
        if delta.finish_reason is not None:
            finish = delta.finish_reason
            break
    return emitted, finish, count, ids


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(loaded):
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [loaded.tokenizer.decode([i]) for i in ids]
    assert "directory" not in pieces  # the stop string below spans several tokens
    emitted, finish, _, _ = feed(loaded, TEXT, ("ory cont",))
    assert emitted == "It is used to list direct"
    assert finish is FinishReason.STOP


def test_earliest_of_several_stop_strings_wins(loaded):
    emitted, finish, _, _ = feed(loaded, TEXT, ("sorted", "list"))
    assert emitted == "It is used to "
    assert finish is FinishReason.STOP


def test_text_without_stop_is_all_emitted(loaded):
    emitted, finish, count, ids = feed(loaded, TEXT, ("zebra",), max_tokens=len(loaded.tokenizer.encode(TEXT)))
    assert emitted == TEXT and finish is FinishReason.LENGTH and count == len(ids)


def test_eos_ends_with_no_text_but_counts(loaded):
    emitted, finish, count, ids = feed(loaded, "Hello", (), extra=[2, 5, 6])
    assert emitted == "Hello" and finish is FinishReason.STOP
    assert count == len(ids) - 2  # the EOS token counts, nothing after it is consumed


@pytest.mark.parametrize("text,stops,expected", [
    ("abc", ("cd",), 1), ("abc", ("bcd",), 2), ("abc", ("x",), 0), ("abc", ("abcd", "c!"), 3), ("", ("a",), 0),
])
def test_held_back_length(text, stops, expected):
    assert _held_back_len(text, stops) == expected


def test_leading_space_of_first_token_is_kept(loaded):
    emitted, _, _, ids = feed(loaded, " is used to", ())
    assert emitted == " is used to" == loaded.tokenizer.decode(ids)
