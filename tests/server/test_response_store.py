"""The Responses API's store on its own: least recently used out by bytes, in memory and on disk
(atomic files read back by a new store in their order, the bound kept, damaged files missed)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from server.response_store import ResponseStore, is_response_id


def record(n: int, pad: int = 0) -> dict[str, Any]:
    return {"response": {"id": f"resp_{n}", "pad": "x" * pad}, "input": []}


def size(rec: dict[str, Any]) -> int:
    return len(json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode())


@pytest.mark.parametrize("on_disk", [False, True])
def test_least_recently_used_go_first(tmp_path: Path, on_disk: bool) -> None:
    one = size(record(1, 100))
    store = ResponseStore(3 * one, tmp_path if on_disk else None)
    for n in (1, 2, 3):
        assert store.put(f"resp_{n}", record(n, 100))
    assert (len(store), store.num_bytes) == (3, 3 * one)
    assert store.get("resp_1") == record(1, 100)  # now the most recently used
    assert store.put("resp_4", record(4, 100))
    assert [n for n in (1, 2, 3, 4) if f"resp_{n}" in store] == [1, 3, 4]
    assert store.get("resp_2") is None and store.num_bytes == 3 * one
    if on_disk:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["resp_1.json", "resp_3.json", "resp_4.json"]


@pytest.mark.parametrize("on_disk", [False, True])
def test_delete_replace_and_oversized(tmp_path: Path, on_disk: bool) -> None:
    store = ResponseStore(size(record(1, 50)), tmp_path if on_disk else None)
    assert store.put("resp_1", record(1, 10))
    assert store.put("resp_1", record(1, 50)) and store.num_bytes == size(record(1, 50))  # replaced, counted once
    assert not store.put("resp_2", record(2, 51)) and "resp_2" not in store  # alone over the bound
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert (len(store), store.num_bytes) == (0, 0)
    assert list(tmp_path.iterdir()) == []
    assert ResponseStore(0).put("resp_1", record(1)) is False


def test_a_new_store_reads_the_directory_back_in_order(tmp_path: Path) -> None:
    one = size(record(1, 100))
    store = ResponseStore(10 * one, tmp_path)
    for n in (1, 2, 3):
        store.put(f"resp_{n}", record(n, 100))
        os.utime(tmp_path / f"resp_{n}.json", ns=(n * 10**9, n * 10**9))  # a clear modification order
    store.get("resp_1")  # touched: the newest now
    again = ResponseStore(10 * one, tmp_path)
    assert (len(again), again.num_bytes) == (3, 3 * one)
    assert again.get("resp_1") == record(1, 100)
    smaller = ResponseStore(2 * one, tmp_path)  # the bound holds on reading back: the oldest (2) goes
    assert ["resp_2" in smaller, "resp_3" in smaller, "resp_1" in smaller] == [False, True, True]
    assert not (tmp_path / "resp_2.json").exists()


def test_damaged_files_and_leftovers_are_misses(tmp_path: Path) -> None:
    store = ResponseStore(2**20, tmp_path)
    store.put("resp_1", record(1))
    store.put("resp_2", record(2))
    (tmp_path / "resp_1.json").write_text('{"response": {"id": ')  # cut short
    (tmp_path / "resp_2.json").write_text('["not", "a", "record"]')
    (tmp_path / ".tmp-abc.json").write_text("half a write")
    (tmp_path / "notes.txt").write_text("not ours")
    assert store.get("resp_1") is None and store.get("resp_2") is None
    assert (len(store), store.num_bytes) == (0, 0) and not (tmp_path / "resp_1.json").exists()
    ResponseStore(2**20, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("text", ["resp_../../etc/passwd", "resp_", "../resp_1", "resp_a.b", "msg_1", "resp_" + "a" * 65,
                                  "resp_\u00e9"])
def test_only_response_ids_are_names(tmp_path: Path, text: str) -> None:
    assert not is_response_id(text)
    with pytest.raises(ValueError):
        ResponseStore(2**20, tmp_path).put(text, record(1))
    assert ResponseStore(2**20, tmp_path).get(text) is None
