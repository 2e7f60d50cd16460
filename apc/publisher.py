"""The KV events publisher: ZMQ PUB and a replay ROUTER, on a thread of their own.

Wire (as vLLM's ``ZmqEventPublisher``): each batch is the multipart message ``[topic, sequence
number as 8 bytes big-endian, msgpack payload]`` on the PUB socket, sequence numbers from 0. A
subscriber that missed some asks the ROUTER socket (a REQ or DEALER client) with the first
sequence number it wants, 8 bytes big-endian; the answer is one message ``[sequence, payload]``
per buffered batch from there on (the last ``buffer_steps`` batches), then ``[-1 as 8 signed
bytes, b""]``, the end marker.

``emit`` only puts the event on a queue (callers, the engine thread among them, never wait on a
socket); the thread takes every event that is waiting as one batch. Endpoints are bound: routers
connect to them (``tcp://*:5557`` for every interface, ``tcp://127.0.0.1:5557`` for loopback).
``open_cache_events`` makes the publisher and the ``CacheEvents`` that feeds it, for the prefix
cache's constructor (``apc.reuse.make_prefix_reuse``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from itertools import count
from typing import Any

import msgspec
import zmq

from apc.events import CacheEvents, KVEventsConfig, make_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05
_MAX_BATCH = 1024  # events a batch holds at most


class ZmqPublisher:
    """Binds its sockets at once (an endpoint in use raises ``zmq.ZMQError``) and publishes until
    ``close``, which sends what is queued first."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[Any] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._buffer_lock = threading.Lock()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._topic = config.topic.encode()
        self._seq = count()
        self._encoder = msgspec.msgpack.Encoder()
        self.published = 0  # batches sent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvarn-kv-events", daemon=True)
        self._thread.start()

    def emit(self, event: Any) -> None:
        """Queue one event (any thread; never blocks)."""
        self._queue.put(event)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._answer_replay()
                except zmq.ZMQError:
                    logger.exception("KV events: a replay request failed")
            events = self._take()
            if events:
                self._publish(events)
            elif self._stop.is_set():
                return

    def _take(self) -> list[Any]:
        try:
            events = [self._queue.get(timeout=_POLL_S)]
        except queue.Empty:
            return []
        while len(events) < _MAX_BATCH:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return events

    def _publish(self, events: list[Any]) -> None:
        seq = next(self._seq)
        payload = self._encoder.encode(make_batch(events, layout=self.config.layout))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            logger.exception("KV events: publishing batch %d failed", seq)
        with self._buffer_lock:
            self._buffer.append((seq, payload))
        self.published += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # [identity, empty delimiter, start]
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        with self._buffer_lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= first]
        for seq, payload in batches:
            self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def open_cache_events(config: KVEventsConfig, cache_block_size: int) -> tuple[CacheEvents, ZmqPublisher]:
    """A bound publisher of ``config`` and the ``CacheEvents`` emitting into it, for a cache of
    blocks of ``cache_block_size`` tokens. Raises ``ValueError`` (a router block size that does
    not divide it) or ``zmq.ZMQError`` (an endpoint in use) with no socket left open."""
    if cache_block_size % config.block_size:
        raise ValueError(f"the KV events block size must divide the prefix cache's block size "
                         f"{cache_block_size} (got {config.block_size})")
    publisher = ZmqPublisher(config)
    logger.info("KV events on %s (replay %s, block size %d)", config.endpoint, config.replay_endpoint,
                config.block_size)
    return CacheEvents(publisher.emit, config.block_size, cache_block_size), publisher
