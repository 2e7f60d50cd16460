"""apc.checkpoint: whole-row snapshot keys extend the salted block chain; the store serves the
longest held proper prefix, checks token ids, and stays within its byte budget."""

from __future__ import annotations

import pytest

from apc.checkpoint import CheckpointStore, snapshot_key
from apc.hashing import root_key

G = 4
ROOT = root_key("stamp", "model")


def test_keys_name_the_exact_token_count_and_salts():
    tokens = list(range(10))
    assert snapshot_key(ROOT, tokens, G) == snapshot_key(ROOT, list(tokens), G)
    assert len({snapshot_key(ROOT, tokens[:n], G) for n in range(11)}) == 11  # every length its own key
    assert snapshot_key(ROOT, tokens, G) != snapshot_key(root_key("stamp", "model", "salt"), tokens, G)
    assert snapshot_key(ROOT, tokens, G) != snapshot_key(root_key("other", "model"), tokens, G)
    assert snapshot_key(ROOT, [1, 2, 3, 4, 5], G) != snapshot_key(ROOT, [1, 2, 3, 4, 6], G)
    assert snapshot_key(ROOT, [9, 2, 3, 4, 5], G) != snapshot_key(ROOT, [1, 2, 3, 4, 5], G)  # via the chain


def test_longest_proper_prefix_wins_and_the_whole_prompt_is_never_served():
    store = CheckpointStore(1000)
    system = [7] * 6
    store.put(ROOT, system, G, "after-system", 10)
    turn = system + [1, 2, 3]
    store.put(ROOT, turn, G, "after-turn-1", 10)
    assert store.longest(ROOT, turn + [4, 5], G) == (9, "after-turn-1")
    assert store.longest(ROOT, turn, G) == (6, "after-system")  # not the whole prompt itself
    assert store.longest(ROOT, system + [9, 9, 9, 9], G) == (6, "after-system")
    assert store.longest(ROOT, [8] * 12, G) is None
    assert store.longest(root_key("stamp", "model", "tenant"), turn + [4], G) is None  # another salt
    assert store.hits == 3


def test_budget_lru_and_clear():
    store = CheckpointStore(25)
    for i in range(3):
        assert store.put(ROOT, [i] * 5, G, f"s{i}", 10)
    assert len(store) == 2 and store.bytes == 20 and store.evicted == 1
    assert store.longest(ROOT, [0] * 8, G) is None and store.longest(ROOT, [2] * 8, G) == (5, "s2")
    assert not store.put(ROOT, [5] * 5, G, "huge", 26) and not store.put(ROOT, [], G, "empty", 1)
    assert store.clear() == 20 and len(store) == 0 and store.longest(ROOT, [2] * 8, G) is None


@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 9])
def test_any_length_snapshots_round_trip(length):
    store = CheckpointStore(100)
    tokens = list(range(100, 100 + length))
    store.put(ROOT, tokens, G, length, 1)
    assert store.longest(ROOT, tokens + [0], G) == (length, length)
