"""Speculative verify in the storage (kvarn/paged.py: PagedRow.hold / verify_room / accept;
kvarn/rows.py: verify_room, begin_verify, end_verify): a verify's drafted tokens live in the
float16 window (sink or tail), never reach the end of their tile (so no record is committed
from an unaccepted token), and rejecting some leaves the row holding exactly its accepted
tokens: byte-identical to a row fed only those (the reference quantizer's bytes for every
record), with no block taken; it then goes on as if never fed the rejected ones."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvarn.layout import KVLayout
from kvarn.paged import PagedRow
from kvarn.pool import KVarNPool
from kvarn.rows import begin_verify, end_verify, verify_room
from kvarn.slots import SlotStore
from tests.kvarn.row_contents import assert_row_holds, assert_same_bytes, row_contents

H, D, G = 2, 128, 64
LAYOUT = KVLayout.kvarn("k4v2", tile_size=G)


def kv(rng: np.random.Generator, n: int) -> tuple[mx.array, mx.array]:
    shape = (1, H, n, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)),
            mx.array((rng.standard_normal(shape) * 0.5).astype(np.float32)))


def two_layer_row() -> PagedRow:
    return PagedRow(KVarNPool(LAYOUT, 2), [0, 1])


def feed(row: PagedRow, k: mx.array, v: mx.array) -> None:
    for view in row.layers.values():
        view.update_and_fetch(k, v)


# (tokens before the verify, verify length, rejected): in the sink, mid-tail, up to the tile's
# last position but one (the longest verify the room allows), all rejected, none rejected
CASES = [(10, 5, 3), (G - 6, 5, 4), (G + 7, 5, 2), (3 * G - 6, 5, 5), (2 * G + 1, G - 2, G - 10), (G + 30, 4, 0)]


@pytest.mark.parametrize("before,length,rejected", CASES)
def test_rejected_drafts_leave_the_row_holding_its_accepted_tokens_only(before, length, rejected):
    """A verify of ``length`` tokens, ``rejected`` of them dropped: every layer holds exactly the
    accepted tokens (window and records the quantizer's bytes), the table did not grow, and the
    row decodes on past the tile's end byte-identical to a row never fed the rejected ones."""
    rng = np.random.default_rng(before + length)
    row, plain = two_layer_row(), two_layer_row()
    k0, v0 = kv(rng, before)
    feed(row, k0, v0)
    feed(plain, k0, v0)
    table, held = list(row.table), row.pool.records.num_held
    assert verify_room(list(row.layers.values())) == G - 1 - before % G >= length
    kd, vd = kv(rng, length)
    begin_verify(list(row.layers.values()))
    feed(row, kd, vd)
    assert row.table == table and row.pool.records.num_held == held  # nothing committed mid-verify
    end_verify(list(row.layers.values()), rejected)
    kept = length - rejected
    keys = mx.concatenate([k0, kd[:, :, :kept]], axis=2)
    values = mx.concatenate([v0, vd[:, :, :kept]], axis=2)
    for view in row.layers.values():
        assert_row_holds(view, keys, values)
    assert row.table == table and row.pool.records.num_held == held and row.draft_from is None
    if kept:
        feed(plain, kd[:, :, :kept], vd[:, :, :kept])
    for _ in range(G + 3):  # one token at a time through the tile's end: commits from accepted tokens only
        k1, v1 = kv(rng, 1)
        feed(row, k1, v1)
        feed(plain, k1, v1)
    for l in row.layers:
        assert_same_bytes(row_contents(row.layers[l]), row_contents(plain.layers[l]))
    assert len(row.table) == len(plain.table)
    row.release()
    assert row.pool.records.num_held == 0  # every block went back


def test_a_verify_cannot_reach_its_tiles_last_position_nor_reject_more_than_it_wrote():
    rng = np.random.default_rng(5)
    row = two_layer_row()
    feed(row, *kv(rng, G + 10))
    room = verify_room(list(row.layers.values()))
    assert room == G - 11
    begin_verify(list(row.layers.values()))
    with pytest.raises(ValueError, match="end of its tile"):
        row.layers[0].update_and_fetch(*kv(rng, room + 1))
    row.layers[0].update_and_fetch(*kv(rng, room))  # the whole room fits
    with pytest.raises(ValueError, match="cannot reject"):
        row.layers[0].reject(room + 1, row.draft_from)
    with pytest.raises(RuntimeError, match="without a verify"):
        two_layer_row().accept(0)


def test_a_row_one_token_before_its_tiles_end_has_no_room_to_verify():
    rng = np.random.default_rng(6)
    row = two_layer_row()
    feed(row, *kv(rng, 2 * G - 1))
    assert verify_room(list(row.layers.values())) == 0


def test_slot_rows_verify_within_their_reservation_and_drop_rejected_tokens():
    """fp16 slot rows: room is the reservation left; rejected tokens leave the row, which then
    holds the prompt and the accepted tokens (the next write lands right after them)."""
    rng = np.random.default_rng(7)
    store = SlotStore()
    row = store.new_row(40)
    k0, v0 = kv(rng, 30)
    row.update_and_fetch(k0, v0)
    assert verify_room([row]) == 10
    kd, vd = kv(rng, 5)
    begin_verify([row])
    row.update_and_fetch(kd, vd)
    end_verify([row], 3)
    assert row.offset == 32
    k1, v1 = kv(rng, 1)
    keys, values = row.update_and_fetch(k1, v1)
    want = mx.concatenate([k0, kd[:, :, :2], k1], axis=2)
    assert np.array_equal(np.array(keys), np.array(want))
    assert np.array_equal(np.array(values), np.array(mx.concatenate([v0, vd[:, :, :2], v1], axis=2)))


def test_caches_that_cannot_drop_tokens_have_no_room():
    from mlx_lm.models.cache import RotatingKVCache

    assert verify_room([RotatingKVCache(max_size=64)]) == 0
