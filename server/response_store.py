"""The Responses API's store: stored responses and their conversations, least recently used first
out once their bytes pass a bound.

Each record is one JSON object (the response, and the conversation it ends: the input items as
resolved plus the output items), counted by the bytes of its JSON text. Without a directory the
records live in memory; with one, each is a file ``<id>.json`` there (written to a temporary
name, then renamed, so a reader never sees half a file) and only the LRU order and sizes are in
memory. A restarted server reads the directory back, oldest modification first, and keeps within
the bound; a file that is not a readable record is a miss (and is removed).

    get/put ──> order: oldest ... newest ──> evict from the oldest end while bytes > max_bytes
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_STORE_BYTES = 64 * 2**20
_ID = re.compile(r"resp_[A-Za-z0-9]{1,64}")
_SUFFIX = ".json"


def is_response_id(text: str) -> bool:
    """Whether ``text`` can name a stored response (``resp_`` and letters or digits): anything
    else is never stored, so it can never reach the file system as a name."""
    return _ID.fullmatch(text) is not None


class ResponseStore:
    """Records by response id, at most ``max_bytes`` of JSON text in all (a record larger than
    that alone is not kept). Invariant: ``num_bytes == sum(sizes)`` and ``num_bytes <=
    max_bytes`` between calls."""

    def __init__(self, max_bytes: int, directory: str | Path | None = None) -> None:
        if max_bytes < 0:
            raise ValueError("the store's byte bound must be >= 0")
        self.max_bytes = max_bytes
        self.directory = Path(directory) if directory is not None else None
        self._sizes: OrderedDict[str, int] = OrderedDict()  # oldest first
        self._records: dict[str, bytes] = {}  # in memory only without a directory
        self.num_bytes = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._load_index()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._sizes

    def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """Keep ``record`` under ``response_id`` (replacing any); False when it alone is over the
        bound, in which case nothing is kept."""
        if not is_response_id(response_id):
            raise ValueError(f"not a response id: {response_id[:80]!r}")
        data = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
        self.delete(response_id)
        if len(data) > self.max_bytes:
            return False
        if self.directory is not None:
            self._write(response_id, data)
        else:
            self._records[response_id] = data
        self._sizes[response_id] = len(data)
        self.num_bytes += len(data)
        self._evict()
        return True

    def get(self, response_id: str) -> dict[str, Any] | None:
        """The record, now the most recently used; None when it is not kept (or its file is damaged)."""
        if response_id not in self._sizes:
            return None
        data = self._records.get(response_id) if self.directory is None else self._read(response_id)
        record = _parse(data)
        if record is None:
            logger.warning("stored response %s is damaged; dropped", response_id)
            self.delete(response_id)
            return None
        self._sizes.move_to_end(response_id)
        if self.directory is not None:
            self._touch(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        """Remove a record; whether there was one."""
        size = self._sizes.pop(response_id, None)
        if size is None:
            return False
        self.num_bytes -= size
        self._records.pop(response_id, None)
        if self.directory is not None:
            self._path(response_id).unlink(missing_ok=True)
        return True

    def _evict(self) -> None:
        while self.num_bytes > self.max_bytes and self._sizes:
            self.delete(next(iter(self._sizes)))

    def _path(self, response_id: str) -> Path:
        assert self.directory is not None
        return self.directory / (response_id + _SUFFIX)

    def _write(self, response_id: str, data: bytes) -> None:
        assert self.directory is not None
        fd, temporary = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            os.replace(temporary, self._path(response_id))
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def _read(self, response_id: str) -> bytes | None:
        try:
            return self._path(response_id).read_bytes()
        except OSError:
            return None

    def _touch(self, response_id: str) -> None:
        try:
            os.utime(self._path(response_id))  # the LRU order a restart reads back
        except OSError:
            pass

    def _load_index(self) -> None:
        """The directory's records, oldest modification first, within the bound; leftovers of an
        interrupted write are removed."""
        assert self.directory is not None
        found = []
        for path in self.directory.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)
                continue
            response_id = path.name.removesuffix(_SUFFIX)
            if path.suffix != _SUFFIX or not is_response_id(response_id) or not path.is_file():
                continue
            stat = path.stat()
            found.append((stat.st_mtime_ns, response_id, stat.st_size))
        for _, response_id, size in sorted(found):
            self._sizes[response_id] = size
            self.num_bytes += size
        self._evict()


def _parse(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("response"), dict) else None
