"""apc.memory_tier: longest-prefix lookup with token checks, LRU-leaf eviction within a byte budget."""

from __future__ import annotations

import random

import pytest

from apc.hashing import BlockKey, block_keys, root_key
from apc.memory_tier import MemoryTier

G = 4
ROOT = root_key("stamp", "model")


def chain(tokens):
    return block_keys(tokens, G, ROOT)


def put_chain(tier: MemoryTier, keys, nbytes: int = 10) -> list[bool]:
    return [tier.insert(k, keys[i - 1] if i else None, f"payload-{k.hex[:6]}", nbytes) for i, k in enumerate(keys)]


def test_longest_prefix_hit_and_token_check():
    tier = MemoryTier(1000)
    keys = chain(list(range(16)))
    assert put_chain(tier, keys[:3]) == [True] * 3
    assert len(tier.lookup(keys)) == 3  # block 3 is not cached
    assert len(tier.lookup(chain(list(range(8)) + [99] * 8))) == 2  # diverges in block 2
    forged = [keys[0], BlockKey(1, keys[1].key, (0, 0, 0, 0))]  # same key, other tokens: never served
    assert len(tier.lookup(forged)) == 1
    assert tier.stats.hit_blocks == 6 and tier.stats.lookups == 3


def test_budget_is_never_exceeded_and_leaves_go_first():
    tier = MemoryTier(50)
    a = chain(list(range(12)))          # 3 blocks
    b = chain(list(range(100, 112)))    # 3 blocks
    put_chain(tier, a)
    put_chain(tier, b[:2])
    assert tier.nbytes == 50 and len(tier) == 5
    assert tier.insert(b[2], b[1], "x", 10)  # evicts a's leaf (a[2]), the oldest leaf
    assert a[2].key not in tier and a[1].key in tier and a[0].key in tier and tier.nbytes == 50
    assert len(tier.lookup(a)) == 2 and tier.stats.evicted == 1


def test_a_hit_refreshes_the_chain_so_it_outlives_colder_ones():
    tier = MemoryTier(40)
    a, b = chain(list(range(8))), chain(list(range(50, 58)))
    put_chain(tier, a)
    put_chain(tier, b)
    tier.lookup(a)  # a is now the most recent
    c = chain(list(range(90, 98)))
    put_chain(tier, c)  # needs 20 bytes: b's two blocks go (leaf first, then its parent)
    assert len(tier.lookup(a)) == 2 and len(tier.lookup(b)) == 0 and len(tier.lookup(c)) == 2


def test_unreachable_and_oversized_blocks_are_refused():
    tier = MemoryTier(25)
    keys = chain(list(range(12)))
    assert not tier.insert(keys[1], keys[0], "orphan", 10)  # its parent is not cached
    assert not tier.insert(keys[0], None, "huge", 26)
    assert tier.stats.refused == 2 and len(tier) == 0
    assert put_chain(tier, keys[:2]) == [True, True]
    # a third block does not fit, and its only evictable leaf would be its own parent: refused
    assert not tier.insert(keys[2], keys[1], "x", 10) and len(tier.lookup(keys)) == 2


def test_random_load_stays_within_budget_and_consistent():
    rng = random.Random(0)
    tier = MemoryTier(300)
    prefixes = [[rng.randrange(1000) for _ in range(4 * G)] for _ in range(6)]
    for _ in range(400):
        base = rng.choice(prefixes)
        tokens = base[: rng.randrange(G, 4 * G + 1)] + [rng.randrange(1000) for _ in range(rng.randrange(0, 3 * G))]
        keys = chain(tokens)
        hits = tier.lookup(keys)
        for i in range(len(hits), len(keys)):
            tier.insert(keys[i], keys[i - 1] if i else None, tokens[i * G:(i + 1) * G], rng.randrange(5, 30))
        assert tier.nbytes <= 300
        # every cached block's parent is cached (nothing unreachable holds bytes)
        for key, entry in tier._entries.items():
            assert entry.parent is None or entry.parent in tier
    assert tier.stats.evicted > 0 and tier.stats.hit_blocks > 0


def test_clear_and_bad_budget():
    tier = MemoryTier(100)
    put_chain(tier, chain(list(range(8))))
    assert tier.clear() == 20 and len(tier) == 0 and tier.nbytes == 0
    with pytest.raises(ValueError):
        MemoryTier(-1)
