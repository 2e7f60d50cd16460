"""``kvarn serve`` on loopback for a benchmark: started on a free port, ready once ``/health``
answers 200, stopped (SIGINT, then SIGKILL) when the block ends. Imported by the scripts in
``bench/`` (run as ``python3 bench/NAME.py``, so this folder is on ``sys.path``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Served:
    base: str  # http://127.0.0.1:PORT
    pid: int  # the server's process (the kvarn command re-executes itself in place: the same pid)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(flags: list[str], log_path: Path, timeout: float = 120.0) -> Iterator[Served]:
    """``kvarn serve`` with ``flags``, its output in ``log_path``; yields once it is ready."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KVARN_API_KEY", None)
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), *flags], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvarn serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvarn serve not ready in {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield Served(base, proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
