"""The disk tier: one file per block under a folder per layout stamp, written behind, verified on read.

    DIR/<layout stamp>/<key hex>.blk     owner-only (0600 files, 0700 folders)

A file is ``MAGIC | header length | JSON header | layout length | JSON layout | payload | digest``:
the header names the format version, the stamp, the key and the block's token ids; the layout
lists the payload's parts (name, dtype, shape, byte range), and is the same text in every file of
a pool layout, so a reader parses and validates each distinct layout once (a chain of 27 files of
the bundled model spent 6 ms parsing headers of 64 part entries each, format 3); the digest is
SHA-256 truncated to 16 bytes over every byte before it (magic, header, layout and payload
alike: a flipped bit anywhere is caught; SHA-256 because CPUs hash it in hardware, 1.4 GB/s here
against BLAKE2b's 0.6), and header and layout are validated field by field (types, dtypes,
ranges, and every part's byte count equal to its shape's) before anything is trusted. Files are written by a background thread (callers never wait on the disk) to a
temporary name of its own and renamed into place, so a file is whole or absent. The index is
rebuilt from the headers at start, and a key it lacks is looked for on disk (another process
sharing the folder may have written it: ``apc.disk_usage`` keeps the cap across processes); every read checks magic, stamp, key, tokens, sizes and checksum, and a file that
fails any check is a miss, is removed and is counted (``stats.bad_files``); so is a file of an
older format. Reads run on a reader thread of their own (``submit``): the engine thread never
waits on the disk either; ``get_many`` reads and verifies a chain's files on a few threads at
once (file reads and hashing release the GIL) and takes them in chain order up to the first miss.
A file removed under a reader is a miss, not a bad file. The folder's bytes stay under a cap,
least recently used files first (access time is kept as the file's mtime). A full,
read-only or otherwise failing disk turns the tier off with one warning: the cache goes on in
memory.

Pure Python: payload parts are bytes with a dtype and shape; the engine thread turns MLX arrays into
parts and back (``apc.blocks``), the writer and reader threads never touch MLX.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from apc.disk_usage import SharedUsage

logger = logging.getLogger(__name__)

MAGIC = b"KVARNAPC4\n"  # format 4: the layout its own section (format 3: in the header; 2: BLAKE2b; 1: digest of the payload only)
VERSION = 4
SUFFIX = ".blk"
DIGEST = 16
READ_THREADS = max(1, min(8, os.cpu_count() or 1))  # files of one chain read at once
DTYPES = {"|u1": 1, "<u2": 2, "<u4": 4, "<i4": 4, "<f2": 2, "<f4": 4, "bfloat16": 2}  # what parts may hold


class Part(NamedTuple):
    """One array of a block payload, as raw little-endian bytes (a read file's parts are views of
    its bytes, not copies). A named tuple: a read makes one a part of every file (1,728 for a
    chain of 27 bundled-model blocks), a frozen dataclass costs five times as much to make."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview


@dataclass
class DiskStats:
    reads: int = 0
    hits: int = 0
    writes: int = 0
    bad_files: int = 0
    evicted: int = 0
    write_errors: int = 0
    bytes: int = 0


def encode(stamp: str, key: bytes, tokens: tuple[int, ...], parts: list[Part]) -> bytes:
    payload = b"".join(p.data for p in parts)
    offset, layout = 0, []
    for p in parts:
        layout.append({"name": p.name, "dtype": p.dtype, "shape": list(p.shape), "offset": offset, "nbytes": len(p.data)})
        offset += len(p.data)
    header = json.dumps({"version": VERSION, "stamp": stamp, "key": key.hex(), "tokens": list(tokens)}).encode()
    parts_text = json.dumps(layout).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + struct.pack("<I", len(parts_text)) + parts_text + payload
    return body + digest(body)


def digest(body: bytes | memoryview) -> bytes:
    """A file's digest of the bytes before it."""
    return hashlib.sha256(body).digest()[:DIGEST]


class BadFile(ValueError):
    pass


def _header(blob: bytes | memoryview) -> tuple[dict, int]:
    """The header of a file (or its first bytes) and where the layout section starts; ``BadFile``
    unless it is a well-formed header of this format."""
    if bytes(blob[: len(MAGIC)]) != MAGIC or len(blob) < len(MAGIC) + 4:
        raise BadFile("bad magic")
    (length,) = struct.unpack_from("<I", blob, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(bytes(blob[start: start + length]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadFile(f"bad header: {exc}") from exc
    if not (isinstance(header, dict) and header.get("version") == VERSION and isinstance(header.get("stamp"), str)
            and isinstance(header.get("key"), str) and isinstance(header.get("tokens"), list)
            and all(isinstance(t, int) for t in header["tokens"])):
        raise BadFile("bad header fields")
    return header, start + length


def _sections(blob: memoryview) -> tuple[dict, bytes, int]:
    """(header, the layout section's text, where the payload starts) of a whole file."""
    header, at = _header(blob)
    if len(blob) < at + 4:
        raise BadFile("no layout section")
    (length,) = struct.unpack_from("<I", blob, at)
    text = bytes(blob[at + 4: at + 4 + length])
    if len(text) != length:
        raise BadFile("layout section cut short")
    return header, text, at + 4 + length


def _layout(entries: list) -> tuple[tuple[str, str, tuple[int, ...], int, int], ...]:
    """A header's part entries, validated: (name, dtype, shape, offset, nbytes) each, the parts
    back to back from offset 0 and every byte count its shape's."""
    out, end = [], 0
    for p in entries:
        try:
            name, dtype, shape, offset, nbytes = p["name"], p["dtype"], p["shape"], p["offset"], p["nbytes"]
        except (KeyError, TypeError) as exc:
            raise BadFile(f"bad part entry: {exc!r}") from exc
        if not (isinstance(name, str) and dtype in DTYPES and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape) and type(offset) is int and offset == end
                and type(nbytes) is int):
            raise BadFile("bad part entry")
        size = DTYPES[dtype]
        for d in shape:
            size *= d
        if size != nbytes:
            raise BadFile("a part's bytes do not match its shape")
        out.append((name, dtype, tuple(shape), offset, nbytes))
        end = offset + nbytes
    return tuple(out)


class _Layouts:
    """The layout sections validated so far, found again by their text (a dict lookup: the files of
    one pool layout all have the same few layouts, byte for byte), so parsing and validating (a
    Python loop a part) happen once per distinct layout, not once per file. Shared by the reader
    threads."""

    def __init__(self, size: int = 8) -> None:
        self._seen: dict[bytes, tuple] = {}
        self._size = size
        self._lock = threading.Lock()

    def validated(self, text: bytes) -> tuple[tuple[str, str, tuple[int, ...], int, int], ...]:
        with self._lock:
            layout = self._seen.get(text)
        if layout is not None:
            return layout
        try:
            entries = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadFile(f"bad layout: {exc}") from exc
        if not isinstance(entries, list):
            raise BadFile("bad layout")
        layout = _layout(entries)
        with self._lock:
            if len(self._seen) >= self._size:
                self._seen.pop(next(iter(self._seen)))  # the oldest
            self._seen[text] = layout
        return layout


_LAYOUTS = _Layouts()


def _parts(layout_text: bytes, payload: memoryview) -> list[Part]:
    layout = _LAYOUTS.validated(layout_text)
    end = layout[-1][3] + layout[-1][4] if layout else 0
    if end != len(payload):
        raise BadFile("payload longer than its parts" if end < len(payload) else "a part's bytes do not match its shape")
    return [Part(name, dtype, shape, payload[offset: offset + nbytes]) for name, dtype, shape, offset, nbytes in layout]


def decode(blob: bytes, stamp: str, key: bytes, tokens: tuple[int, ...]) -> list[Part]:
    """The parts of a file (views of ``blob``), or ``BadFile`` if it is not exactly what was asked
    for, whole."""
    view = memoryview(blob)
    if len(blob) < DIGEST or digest(view[:-DIGEST]) != blob[-DIGEST:]:
        raise BadFile("checksum mismatch")
    header, layout_text, start = _sections(view)
    if header["stamp"] != stamp or header["key"] != key.hex():
        raise BadFile("wrong stamp or key")
    if tuple(header["tokens"]) != tuple(tokens):
        raise BadFile("other tokens")
    return _parts(layout_text, view[start: len(blob) - DIGEST])


@dataclass
class DiskTier:
    root: Path
    stamp: str
    cap_bytes: int
    stats: DiskStats = field(default_factory=DiskStats)

    def __post_init__(self) -> None:
        self.folder = Path(self.root) / self.stamp
        self.enabled = True
        self._lock = threading.Lock()
        self._index: dict[bytes, tuple[int, float]] = {}  # key -> (bytes, last use)
        self._lengths: dict[bytes, int] = {}  # key -> how many tokens the file is for
        self._queue: queue.Queue[tuple | threading.Event | None] = queue.Queue()
        self._usage: SharedUsage | None = None
        # what a replica tells routers (``apc.events``): a written block's note, keys removed
        self.on_written: Callable[[Any], None] | None = None
        self.on_removed: Callable[[list[bytes]], None] | None = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.folder, 0o700)
            self._usage = SharedUsage(self.folder, SUFFIX)
            self._rebuild_index()
        except OSError as exc:
            self._disable(f"cannot use {self.folder}: {exc}")
        self._writer = threading.Thread(target=self._write_loop, name="kvarn-apc-disk", daemon=True)
        self._writer.start()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, name="kvarn-apc-read", daemon=True)
        self._reader.start()
        self._pool: ThreadPoolExecutor | None = None  # get_many's file readers, made on first use

    # --- index ---
    def _rebuild_index(self) -> None:
        for path in self.folder.glob("*" + SUFFIX):
            try:
                key = bytes.fromhex(path.stem)
                stat = path.stat()
                with path.open("rb") as f:
                    head = f.read(len(MAGIC) + 4)
                    length = struct.unpack_from("<I", head, len(MAGIC))[0] if len(head) == len(MAGIC) + 4 else 0
                    header, _ = _header(head + f.read(length))
                if header.get("key") != path.stem or header.get("stamp") != self.stamp:
                    raise BadFile("header does not match its name")
            except FileNotFoundError:  # removed since the listing (another process's eviction): not bad
                continue
            except (OSError, ValueError):
                self._remove_bad(path)
                continue
            self._index[key] = (stat.st_size, stat.st_mtime)
            self._lengths[key] = len(header.get("tokens", ()))
        # writes cut short by a crash (counted as bad files; recent ones may be another process's, live)
        self.stats.bad_files += self._usage.remove_stale_tmp()
        self.stats.bytes = self._usage.rescan()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return self._discover(key)

    def _discover(self, key: bytes) -> bool:
        """Whether another process sharing the folder wrote ``key`` (then it joins the index)."""
        if not self.enabled:
            return False
        try:
            stat = self._path(key).stat()
        except OSError:
            return False
        with self._lock:
            self._index.setdefault(key, (stat.st_size, stat.st_mtime))
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # --- reading (caller's thread) ---
    def get(self, key: bytes, tokens: tuple[int, ...]) -> list[Part] | None:
        found = self.get_many([(key, tokens)])
        return found[0] if found else None

    def get_many(self, blocks: Sequence[tuple[bytes, tuple[int, ...]]]) -> list[list[Part]]:
        """The parts of ``blocks`` (key, tokens), in order, up to the first miss: a block without
        a file, or a bad file (removed and counted). Several files are read and verified
        concurrently; files after the first miss are neither counted nor touched."""
        with self._lock:
            if not self.enabled:
                return []
            indexed = [key in self._index for key, _ in blocks]
        known = []
        for (key, tokens), is_known in zip(blocks, indexed):
            if not (is_known or self._discover(key)):
                break
            known.append((key, tokens))
        if len(known) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="kvarn-apc-read")
            results = list(self._pool.map(lambda b: self._read(*b), known))
        else:
            results = [self._read(*b) for b in known]
        found: list[list[Part]] = []
        for (key, _), (path, parts, exc) in zip(known, results):
            self.stats.reads += 1
            if isinstance(exc, FileNotFoundError):  # removed meanwhile (an evictor, maybe another process's)
                with self._lock:
                    self._index.pop(key, None)
                    self._lengths.pop(key, None)
                break
            if parts is None:
                logger.warning("prefix cache: bad block file %s (%s): removed", path.name, exc)
                self._remove_bad(path, key)
                break
            with self._lock:
                if key in self._index:
                    self._index[key] = (self._index[key][0], _touch(path))
            self.stats.hits += 1
            found.append(parts)
        return found

    def _read(self, key: bytes, tokens: tuple[int, ...]) -> tuple[Path, list[Part] | None, Exception | None]:
        path = self._path(key)
        try:
            return path, decode(path.read_bytes(), self.stamp, key, tokens), None
        except (OSError, BadFile) as exc:
            return path, None, exc

    def discard_bad(self, key: bytes) -> None:
        """A file that verified but whose block could not be used (it does not fit the layout):
        removed and counted like a damaged one."""
        logger.warning("prefix cache: block file %s does not fit this layout: removed", key.hex())
        self._remove_bad(self._path(key), key)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` (reads, through ``get``) on the reader thread, in submission order."""
        self._jobs.put(job)

    def _read_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # a job reports its own result; this keeps the reader alive
                logger.exception("prefix cache: a disk read job failed")

    # --- writing (background thread) ---
    def put(self, key: bytes, tokens: tuple[int, ...], parts: list[Part], note: Any = None) -> None:
        """Queue a block for writing (returns at once; an existing block is left as it is).
        ``note``: handed to ``on_written`` once the block is on disk."""
        with self._lock:
            if not self.enabled or key in self._index:
                return
        self._queue.put((key, len(tokens), encode(self.stamp, key, tokens, parts), note))

    def lengths(self) -> set[int]:
        """The token counts the files are for (the checkpoint tier looks snapshots up by length)."""
        with self._lock:
            return set(self._lengths.values())

    def clear(self) -> int:
        """Remove every block file of the folder, whoever wrote it (after the queued writes);
        returns the bytes released."""
        self.flush()
        with self._lock:
            self._index.clear()
            self._lengths.clear()
        if self._usage is None:
            return 0
        with self._usage.locked():
            released = 0
            for path in self.folder.glob("*" + SUFFIX):
                try:
                    size = path.stat().st_size
                    path.unlink()
                    released += size
                except OSError:
                    pass
        self.stats.bytes = self._usage.rescan()
        return released

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write is done (tests, shutdown)."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._jobs.put(None)
        self._writer.join(10)
        self._reader.join(10)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._usage is not None:
            self._usage.close()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):  # a flush: everything queued before it is written
                item.set()
            elif self.enabled:
                self._write(*item)

    def _write(self, key: bytes, length: int, blob: bytes, note: Any) -> None:
        if key in self or len(blob) > self.cap_bytes:  # queued twice, or another process wrote it
            if key in self and note is not None and self.on_written is not None:
                self.on_written(note)
            return
        path = self._path(key)
        tmp = self._usage.tmp_path(key.hex())  # a name of its own: writers of one key never share one
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            # room made and the file renamed into place under the folder's lock, in one step
            self.stats.bytes, removed, placed = self._usage.admit(tmp, path, len(blob), self.cap_bytes)
        except OSError as exc:
            self.stats.write_errors += 1
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._disable(f"writing {path.name} failed: {exc}")
            return
        self._forget_removed(removed)
        with self._lock:
            self._index[key] = (len(blob), _touch(path))
            self._lengths[key] = length
        self.stats.writes += placed
        if note is not None and self.on_written is not None:
            self.on_written(note)

    def _forget_removed(self, removed: list[Path]) -> None:
        """Files the byte budget removed (this process's or another's) leave the index."""
        keys = []
        for path in removed:
            try:
                keys.append(bytes.fromhex(path.stem))
            except ValueError:
                continue
        with self._lock:
            for key in keys:
                self._index.pop(key, None)
                self._lengths.pop(key, None)
        self.stats.evicted += len(keys)
        if keys and self.on_removed is not None:
            self.on_removed(keys)

    # --- helpers ---
    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def _remove_bad(self, path: Path, key: bytes | None = None) -> None:
        self.stats.bad_files += 1
        with self._lock:
            if key is not None:
                self._index.pop(key, None)
                self._lengths.pop(key, None)
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            return
        if self._usage is not None:
            self._usage.release(size)
        if key is not None and self.on_removed is not None:
            self.on_removed([key])

    def _disable(self, why: str) -> None:
        with self._lock:
            was, self.enabled = self.enabled, False
        if was:
            logger.warning("prefix cache: disk tier off, memory only from now on (%s)", why)


def _touch(path: Path) -> float:
    try:
        os.utime(path)
        return path.stat().st_mtime
    except OSError:
        return 0.0
