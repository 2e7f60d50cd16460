"""EngineClient: the one thread that owns MLX, bridged to asyncio with per-request queues.

The thread loads the model, then loops: take commands (add, abort) from its inbox, run one
engine step, and hand each output to its request's asyncio queue with ``call_soon_threadsafe``.
Nothing outside this thread touches MLX.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.request import Request, RequestId, RequestOutput, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.kv_config import KVConfig

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


@dataclass(frozen=True)
class EngineConfig:
    """What to load and how to run it."""

    model_path: str | None = None
    model_id: str | None = None
    dtype: str = "auto"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv: KVConfig = field(default_factory=KVConfig)


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs to know about the loaded model (no MLX objects)."""

    model_id: str
    context_length: int
    fingerprint: str
    compute_dtype: str
    kv_cache: dict[str, Any]
    vocab_size: int


class EngineNotReady(RuntimeError):
    pass


class EngineClient:
    """Thread-safe facade over ``Engine``. ``start()`` returns at once; ``ready`` is set when the
    model is loaded (or ``load_error`` when it could not be)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.info: ModelInfo | None = None
        self._tokenizer: Any = None
        self._inbox: queue.Queue[Callable[[Any], None]] = queue.Queue()
        self._streams: dict[RequestId, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._stats = {"running": 0, "waiting": 0, "kv_bytes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="kvarn-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(lambda engine: None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- tokenizer (pure Python, safe from any thread) ---
    def encode(self, text: str) -> list[int]:
        return list(self._require_tokenizer().encode(text, add_special_tokens=False))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = self._require_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def decode_token(self, token_id: int) -> str:
        return self._require_tokenizer().decode([token_id])

    def _require_tokenizer(self) -> Any:
        if not self.ready.is_set() or self._tokenizer is None:
            raise EngineNotReady("the model is still loading")
        return self._tokenizer

    # --- requests ---
    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has ``finish_reason`` set. Leaving the loop
        early (a client disconnect cancels it) aborts the request inside the engine."""
        if not self.ready.is_set():
            raise EngineNotReady("the model is still loading")
        rid = RequestId(request_id or uuid.uuid4().hex)
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), outputs)
        request = Request(rid, list(prompt_ids), params)
        self._inbox.put(lambda engine: engine.add_request(request))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(lambda engine: engine.abort_request(RequestId(request_id)))

    # --- the engine thread ---
    def _main(self) -> None:
        try:
            from engine.engine import make_engine
            from engine.loader import load_model

            loaded = load_model(self.config.model_path, self.config.dtype, self.config.model_id)
            engine = make_engine(loaded, self.config.scheduler, self.config.kv)
            self._tokenizer = loaded.tokenizer
            self.info = ModelInfo(loaded.model_id, loaded.context_length, loaded.fingerprint,
                                  loaded.compute_dtype, engine.describe_kv(), loaded.vocab_size)
        except BaseException as exc:  # reported through /health; the server stays up to say so
            logger.exception("model load failed")
            self.load_error = exc
            self.ready.set()
            return
        self.ready.set()
        while not self._stop.is_set():
            self._run_commands(engine, block=not engine.has_work())
            if engine.has_work():
                self._step(engine)

    def _run_commands(self, engine: Any, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            output = command(engine)
            if isinstance(output, RequestOutput):
                self._dispatch(output)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._update_stats(engine)

    def _step(self, engine: Any) -> None:
        try:
            outputs = engine.step()
        except Exception:  # the runner already isolates row failures; this is a last resort
            logger.exception("engine step failed; aborting its requests")
            outputs = [engine.abort_request(rid) for rid in list(engine.requests)]
        for output in outputs:
            if output is not None:
                self._dispatch(output)
        self._update_stats(engine)

    def _update_stats(self, engine: Any) -> None:
        self._stats = {"running": engine.num_running, "waiting": engine.num_waiting,
                       "kv_bytes": engine.runner.kv_nbytes()}

    def _dispatch(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, output)
