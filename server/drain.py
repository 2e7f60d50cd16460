"""Graceful drain: on SIGTERM (or SIGINT) a replica stops taking requests and finishes the ones it has.

    signal -> draining: /health answers 503 {"status": "draining"} (routers stop sending), new
              requests get 503 + Retry-After in their API's error shape (``EngineClient.draining``)
           -> in-flight HTTP requests finish (streams included), up to ``drain_timeout`` seconds
           -> whatever is left ends with a clean error (``EngineClient.fail_all``)
           -> uvicorn shuts down: the lifespan stops the engine, which writes the prefix cache's
              queued disk blocks and closes the KV events publisher; the process exits 0

Uvicorn's own signal handling would stop at once and let sse-starlette end every open stream,
so ``DrainingServer`` takes SIGTERM and SIGINT itself; a second signal forces the exit.
``CountInFlight`` counts the HTTP requests being answered (an ASGI middleware: a streamed response
counts until its last byte is sent); /health and /metrics are not counted.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from sse_starlette.sse import AppStatus

logger = logging.getLogger("kvarn")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
_AFTER_FAIL_S = 5.0  # after failing what was left, how long its clients get to read the error
_UNCOUNTED = ("/health", "/metrics")


class InFlight:
    """How many HTTP requests are being answered; ``idle`` is set at zero."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()


class CountInFlight:
    """ASGI middleware keeping ``counter`` (an ``InFlight``) up to date."""

    def __init__(self, app: Any, counter: InFlight) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in _UNCOUNTED:
            await self.app(scope, receive, send)
            return
        counter = self.counter
        counter.count += 1
        counter.idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            counter.count -= 1
            if counter.count == 0:
                counter.idle.set()


def find_in_flight(app: Any) -> InFlight | None:
    return getattr(app.state, "in_flight", None)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGTERM/SIGINT drain ``app`` before it shuts down."""

    def __init__(self, config: uvicorn.Config, app: Any, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        super().__init__(config)
        self.app, self.drain_timeout = app, drain_timeout
        self._drain: asyncio.Task | None = None
        AppStatus.disable_automatic_graceful_drain()  # streams end when they are done, not at the signal

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._drain is not None:  # a second signal: stop now
            logger.warning("second %s: exiting without waiting", signal.Signals(sig).name)
            AppStatus.should_exit = True
            self.should_exit = self.force_exit = True
            return
        logger.info("%s: draining (up to %.0f s for %d requests in flight)", signal.Signals(sig).name,
                    self.drain_timeout, self._count())
        self._drain = asyncio.get_running_loop().create_task(self.drain())

    def _count(self) -> int:
        in_flight = find_in_flight(self.app)
        return in_flight.count if in_flight is not None else 0

    async def drain(self) -> None:
        client = self.app.state.client
        client.draining = True
        in_flight = find_in_flight(self.app)
        if in_flight is not None and not await _wait(in_flight.idle, self.drain_timeout):
            logger.warning("drain timeout: ending %d requests still in flight", in_flight.count)
            client.fail_all("The server shut down before this request finished (its drain timeout passed); "
                            "retry it.")
            await _wait(in_flight.idle, _AFTER_FAIL_S)
        logger.info("drained: shutting down")
        AppStatus.should_exit = True
        self.should_exit = True


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True
