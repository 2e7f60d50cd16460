"""The two wire layouts of KV events (``apc/events.py: make_batch``): every event a msgpack array
(vLLM's published subscriber example) or a map tagged by ``type`` (later vLLM releases,
vllm-router), read back by decoders written for each, with the same content."""

from __future__ import annotations

import msgspec
import pytest

from apc.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig, make_batch


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list
    data_parallel_rank: int | None = None


EVENTS = [BlockStored([11, 12], 10, list(range(32)), 16, None, "GPU", None), BlockRemoved([13], "DISK"),
          AllBlocksCleared()]


def test_the_array_layout_is_vllms_subscriber_example():
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(make_batch(EVENTS, rank=0)))
    assert raw[1] == [["BlockStored", [11, 12], 10, list(range(32)), 16, None, "GPU", None],
                      ["BlockRemoved", [13], "DISK"], ["AllBlocksCleared"]]
    assert raw[2] == 0


def test_the_map_layout_tags_each_event_by_type():
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(make_batch(EVENTS, rank=0, layout="map")))
    assert isinstance(raw, list) and raw[2] == 0  # the batch stays an array
    assert raw[1] == [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 10,
                       "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                       "lora_name": None},
                      {"type": "BlockRemoved", "block_hashes": [13], "medium": "DISK"},
                      {"type": "AllBlocksCleared"}]


class ArrayEvent(msgspec.Struct, array_like=True, tag=True):
    """A reader of the array layout (vLLM's subscriber example)."""


class ArrayStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class ArrayRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayBatch(Batch):
    events: list[ArrayStored | ArrayRemoved | ArrayCleared]


class MapEvent(msgspec.Struct, tag=True):
    """A reader of the map layout (tagged by ``type``, as vllm-router reads events)."""


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(Batch):
    events: list[MapStored | MapRemoved | MapCleared]


@pytest.mark.parametrize("layout,reader,cleared", [("array", ArrayBatch, ArrayCleared), ("map", MapBatch, MapCleared)])
def test_a_typed_decoder_of_each_layout_reads_the_same_events(layout, reader, cleared):
    got = msgspec.msgpack.Decoder(type=reader).decode(msgspec.msgpack.encode(make_batch(EVENTS, layout=layout)))
    stored, removed, end = got.events
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium) == \
        ([11, 12], 10, list(range(32)), 16, "GPU")
    assert (removed.block_hashes, removed.medium) == ([13], "DISK") and isinstance(end, cleared)


def test_a_reader_of_one_layout_refuses_the_other():
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(type=MapBatch).decode(msgspec.msgpack.encode(make_batch(EVENTS)))


def test_the_layout_is_the_configs():
    assert KVEventsConfig("tcp://127.0.0.1:5557").layout == "array"
    assert KVEventsConfig("tcp://127.0.0.1:5557", layout="map").layout == "map"
