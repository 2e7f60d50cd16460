"""The disk tier's byte budget, kept across every process that shares its folder.

Several replicas may use one ``--apc-disk-dir``. Each keeps its own index of the files it knows,
but the cap is the folder's: the bytes of every process's files count. ``SharedUsage`` keeps the
folder's total in a small file (``.usage``, 8 bytes) that writers and evictors update under an
exclusive ``fcntl.flock`` on ``.lock`` (and a thread lock, as flock does not exclude the threads
of one process). A writer writes and syncs its file under a temporary name first, then, under the
lock, makes room and renames it into place in one step (``admit``): every byte the total counts is
in a block file, so an eviction scan (which sees block files only) never misses another writer's
write in flight, and the folder never passes its cap. When the total would pass the cap, the scan
reads the real sizes, whoever wrote them, and removes least recently used files (a file's mtime is
its last use: readers touch it) down to a low-water mark, so a scan is needed once per
``1 - LOW_WATER`` of the cap, not once per write. The total is raised before the rename, so a
process that dies between the two leaves it too high, never too low; the next scan corrects it.

A removed file is never half-read: a reader that opened it first reads it whole (POSIX keeps an
unlinked file's data for the open descriptor), one that comes after gets a miss. Temporary files
are never counted nor scanned: a starting process removes only those of writers that are gone
(and any older than ``STALE_TMP_S``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOW_WATER = 0.9  # an eviction scan leaves the folder at this share of the cap
STALE_TMP_S = 60.0  # a temporary file this old belongs to a write that died (a write takes milliseconds)
_USAGE, _LOCK = ".usage", ".lock"


class SharedUsage:
    """The byte total of the block files in ``folder`` (``suffix``), shared by processes."""

    def __init__(self, folder: Path, suffix: str) -> None:
        self.folder, self.suffix = folder, suffix
        self._thread_lock = threading.Lock()
        fd = os.open(folder / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        self._lock_fd = fd

    def close(self) -> None:
        os.close(self._lock_fd)

    @contextmanager
    def locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def total(self) -> int:
        with self.locked():
            return self._read()

    def rescan(self) -> int:
        """Set the total to the folder's real bytes (start-up); returns it."""
        with self.locked():
            total = sum(size for _, size, _ in self._files())
            self._write(total)
            return total

    def admit(self, tmp: Path, path: Path, nbytes: int, cap: int) -> tuple[int, list[Path], bool]:
        """Rename the written, synced temporary file ``tmp`` (``nbytes``) to ``path``, first removing
        least recently used files if the folder would pass ``cap``. Room and rename are one step
        under the lock. Returns the new total, the files removed, and whether ``tmp`` was placed
        (False: another process put ``path`` in place meanwhile, and ``tmp`` is dropped)."""
        with self.locked():
            if path.exists():
                tmp.unlink(missing_ok=True)
                return self._read(), [], False
            total, removed = self._make_room(nbytes, cap)
            self._write(total + nbytes)  # counted before it lands: a crash leaves the total too high
            try:
                os.replace(tmp, path)
            except OSError:
                self._write(total)
                raise
            return total + nbytes, removed, True

    def _make_room(self, nbytes: int, cap: int) -> tuple[int, list[Path]]:
        """(the total, the files removed) once ``nbytes`` more fit under ``cap``; under the lock."""
        total = self._read()
        removed: list[Path] = []
        if total + nbytes <= cap:
            return total, removed
        files = sorted(self._files())  # oldest use first
        total = sum(size for _, size, _ in files)
        target = min(int(cap * LOW_WATER), cap - nbytes)
        for _, size, path in files:
            if total + nbytes <= target:
                break
            try:
                path.unlink()
            except FileNotFoundError:  # another process took it meanwhile
                pass
            total -= size
            removed.append(path)
        return total, removed

    def release(self, nbytes: int) -> None:
        """Take ``nbytes`` off the total (a file removed, or a write that did not land)."""
        with self.locked():
            self._write(max(self._read() - nbytes, 0))

    def tmp_path(self, name: str) -> Path:
        """A temporary file name no other writer uses: ``NAME.HOST-PID-THREAD.tmp``."""
        return self.folder / f"{name}.{_HOST}-{os.getpid()}-{threading.get_ident():x}.tmp"

    def remove_stale_tmp(self) -> int:
        """Remove temporary files of writes that died: this host's whose process is gone, and any
        older than ``STALE_TMP_S`` (another host's or container's may be a live write). Returns
        how many."""
        now, removed = time.time(), 0
        for tmp in self.folder.glob("*.tmp"):
            try:
                if _is_dead_here(tmp.name) or now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink()
                    removed += 1
            except OSError:
                pass
        return removed

    def _files(self) -> list[tuple[float, int, Path]]:
        out = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if not entry.name.endswith(self.suffix):
                    continue
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue
                out.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        return out

    def _read(self) -> int:
        try:
            data = (self.folder / _USAGE).read_bytes()
        except FileNotFoundError:
            return 0
        return int.from_bytes(data[:8], "little") if len(data) >= 8 else 0

    def _write(self, total: int) -> None:
        tmp = self.tmp_path(_USAGE)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(max(total, 0).to_bytes(8, "little"))
        os.replace(tmp, self.folder / _USAGE)


_HOST = socket.gethostname().replace(".", "_").replace("-", "_") or "host"


def _is_dead_here(name: str) -> bool:
    """Whether a temporary file was written by a process of this host that no longer runs (a
    name without a writer, from an older writer, counts as dead)."""
    parts = name.rsplit(".", 2)  # NAME . HOST-PID-THREAD . tmp
    writer = parts[1].split("-") if len(parts) == 3 else []
    if len(writer) != 3 or not writer[1].isdigit():
        return True
    if writer[0] != _HOST:
        return False
    try:
        os.kill(int(writer[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
