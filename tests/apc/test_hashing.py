"""apc.hashing: chained block keys salted by layout, model and cache_salt; stable across
processes; the last prompt token never falls in a reusable block."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apc.hashing import BlockKey, block_keys, prompt_keys, reusable_blocks, root_key

G = 4
ROOT = root_key("stamp-a", "model-a")


def test_keys_chain_every_earlier_token():
    tokens = list(range(100, 112))
    keys = block_keys(tokens, G, ROOT)
    assert [k.index for k in keys] == [0, 1, 2] and keys[1].tokens == (104, 105, 106, 107)
    changed = block_keys([99] + tokens[1:], G, ROOT)  # one token of block 0 changes every key after it
    assert all(a.key != b.key for a, b in zip(keys, changed))
    later = block_keys(tokens[:8] + [0, 0, 0, 0], G, ROOT)  # a change in block 2 leaves blocks 0-1 alone
    assert [k.key for k in later[:2]] == [k.key for k in keys[:2]] and later[2].key != keys[2].key


def test_same_block_at_another_position_or_after_another_prefix_has_another_key():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], G, ROOT)
    b = block_keys([5, 6, 7, 8, 1, 2, 3, 4], G, ROOT)
    assert a[0].key != b[1].key and a[1].key != b[0].key


@pytest.mark.parametrize("other", [root_key("stamp-b", "model-a"), root_key("stamp-a", "model-b"),
                                   root_key("stamp-a", "model-a", "tenant-1")])
def test_layout_model_and_salt_each_change_every_key(other):
    tokens = list(range(8))
    assert not {k.key for k in block_keys(tokens, G, ROOT)} & {k.key for k in block_keys(tokens, G, other)}


def test_no_salt_and_empty_salt_agree():
    assert root_key("s", "m", None) == root_key("s", "m", "") == root_key("s", "m")
    assert root_key("s", "m", "x") != root_key("s", "m", "y")


def test_parts_are_length_prefixed():
    # "ab" + "c" and "a" + "bc" must not meet at the root
    assert root_key("ab", "c") != root_key("a", "bc")


@pytest.mark.parametrize("n,expected", [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3)])
def test_the_last_prompt_token_is_never_in_a_reusable_block(n, expected):
    assert reusable_blocks(n, G) == expected
    keys = prompt_keys(list(range(n)), G, ROOT)
    assert len(keys) == expected and all((k.index + 1) * G <= n - 1 for k in keys)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=64), st.integers(1, 16))
def test_prefix_property(tokens, block_size):
    """Keys of a prefix are the first keys of the whole (what makes a chain a prefix index)."""
    whole = block_keys(tokens, block_size, ROOT)
    for cut in range(len(tokens) + 1):
        assert block_keys(tokens[:cut], block_size, ROOT) == whole[: cut // block_size]


# a key written to disk by one version must be found by the next: changing the key format means
# bumping apc.hashing.KEY_VERSION (which changes every key) and this value
GOLDEN = "7b1d364ba7ab0a9788795104ebb18701"


def test_keys_are_stable_across_processes_and_versions():
    code = ("from apc.hashing import block_keys, root_key; "
            "print(block_keys(list(range(40)), 16, root_key('st', 'fp', 'salt'))[1].hex)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"}, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == GOLDEN
    assert block_keys(list(range(40)), 16, root_key("st", "fp", "salt"))[1].hex == GOLDEN


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, ROOT)
    with pytest.raises(Exception):  # struct.error: ids are uint32
        block_keys([-1, 0, 0, 0], G, ROOT)
    assert isinstance(block_keys([1, 2, 3, 4], G, ROOT)[0], BlockKey)
