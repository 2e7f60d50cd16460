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
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.chat_format import ChatFormat, OutputParser, chat_format_of, chat_prompt_ids
from engine.constraints import Constraint, ConstraintCompiler, GrammarSpec
from engine.request import FinishReason, Request, RequestId, RequestOutput, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.kv_config import ApcConfig, KVConfig
from engine.memory import mlx_memory
from engine.output import decode_exactly, token_bytes_of

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
    apc: ApcConfig = field(default_factory=ApcConfig)
    max_queue: int = 1024  # requests waiting for admission beyond this are refused (429)
    # special-token text typed in chat message content is parsed as control tokens (engine/chat_format.py)
    parse_special: bool = False
    # run engine/warm_up.py's workload before serving (None: where MLX's default device is a GPU)
    warm_up: bool | None = None
    # speculative decoding (an engine.speculator.SpecConfig; None: off)
    speculative: Any = None


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs to know about the loaded model (no MLX objects)."""

    model_id: str
    context_length: int
    fingerprint: str
    compute_dtype: str
    kv_cache: dict[str, Any]
    vocab_size: int
    chat_format: ChatFormat = field(default_factory=ChatFormat)  # think and tool-call markers (mlx-lm's)
    max_token_chars: int = 0  # the most characters one token decodes to (0: unknown), for cheap length bounds
    speculative: dict[str, Any] | None = None  # speculative decoding in force (None: off)


class EngineNotReady(RuntimeError):
    pass


class RequestRejected(Exception):
    """A request refused before it reaches the engine: ``status`` 400 (it can never fit in the
    KV budget) or 429 (the waiting queue is full; retry after ``retry_after`` seconds)."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


class Admission:
    """A request's place at the front door: held from ``check_admission`` until the engine takes
    the request (``release``, idempotent), or until the holder drops it (a client that left
    before its stream started)."""

    def __init__(self, client: EngineClient) -> None:
        self._client: EngineClient | None = client

    def release(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.release_admission()

    def __del__(self) -> None:
        self.release()


class EngineClient:
    """Thread-safe facade over ``Engine``. ``start()`` returns at once; ``ready`` is set when the
    model is loaded (or ``load_error`` when it could not be)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.info: ModelInfo | None = None
        self._tokenizer: Any = None
        self._compiler: ConstraintCompiler | None = None
        self._inbox: queue.Queue[Callable[[Any], None]] = queue.Queue()
        self._streams: dict[RequestId, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._stats = {"running": 0, "waiting": 0, "kv_bytes": 0, "reserved_bytes": 0}
        self._submitted = 0  # requests past the front door whose add the engine has not taken yet
        self._max_num_seqs = config.scheduler.max_num_seqs
        self._lock = threading.Lock()
        self._cost: Callable[[int, int, int], int] | None = None
        self._budget: int | None = None
        self._stop = threading.Event()
        self.draining = False  # shutting down: new requests are refused with 503 (server/app.py: DrainingServer)
        self._used = False  # work ran since memory was last released (engine thread only)
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

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The model's chat template over ``messages`` (and ``tools``, OpenAI's function tools as
        dicts, which the template lists for the model; ``template_kwargs``, the template's extra
        variables such as ``enable_thinking``), tokenized; special-token text inside a message's
        content stays text unless ``EngineConfig.parse_special`` (engine/chat_format.py)."""
        return chat_prompt_ids(self._require_tokenizer(), messages, add_generation_prompt=add_generation_prompt,
                               tools=tools, parse_special=self.config.parse_special, template_kwargs=template_kwargs)

    def output_parser(self, prompt_ids: list[int], *, tools: list[dict[str, Any]] | None = None,
                      parse_tools: bool = False, reasoning: bool = True) -> OutputParser:
        """A fresh splitter of one chat choice's text into content, reasoning (``reasoning``: the
        model's think markers, if it has them) and tool calls (``parse_tools``: the model's
        tool-call format, if mlx-lm knows one). Pure Python: use it on any thread."""
        return OutputParser(self._require_tokenizer(), tools=tools, parse_tools=parse_tools, reasoning=reasoning,
                            prompt_ids=prompt_ids)

    def decode_token(self, token_id: int) -> str:
        return self._require_tokenizer().decode([token_id])

    def text_of(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` exactly as the engine's logprob entries piece it together
        (``engine/output.py``): multi-byte characters split across tokens come out whole."""
        return decode_exactly(token_bytes_of(self._require_tokenizer()), token_ids)

    # --- grammar constraints (engine/constraints.py) ---
    async def compile_constraint(self, spec: GrammarSpec) -> Constraint:
        """Compile ``spec`` for the served model on a worker thread (never on the event loop),
        for ``SamplingParams.constraint``. Raises ``ConstraintError`` (a 400) for a grammar that
        is invalid, unsatisfiable or unsupported, before the request is queued."""
        if not self.ready.is_set() or self._compiler is None:
            raise EngineNotReady("the model is still loading")
        return await asyncio.to_thread(self._compiler.compile, spec)

    def _require_tokenizer(self) -> Any:
        if not self.ready.is_set() or self._tokenizer is None:
            raise EngineNotReady("the model is still loading")
        return self._tokenizer

    # --- requests ---
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._stats, "budget_bytes": self._budget or 0}

    def check_admission(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> Admission:
        """Admit a request at the front door, before a response starts, or raise
        ``RequestRejected``: 400 if it can never fit in the KV budget, 429 if the waiting queue
        is full. The returned ``Admission`` holds the request's queue place until ``generate``
        hands it to the engine (or until it is dropped), so a burst cannot overfill the queue."""
        if self.draining:
            raise RequestRejected(503, "This server is shutting down and takes no new requests; retry shortly "
                                       "(another replica will answer).", code="server_draining", retry_after=1)
        if self._cost is not None and self._budget is not None:
            need = self._cost(prompt_tokens, max_tokens, n)  # the engine's own admission price
            if need > self._budget:
                raise RequestRejected(400, f"This request needs {need:,} bytes of KV cache (a {prompt_tokens}-token "
                                           f"prompt + max_tokens {max_tokens}, n={n}) but the server's whole KV "
                                           f"budget is {self._budget:,} bytes. Reduce max_tokens, the prompt or n.",
                                      code="kv_budget_exceeded")
        with self._lock:
            # requests on their way in may still find a free row; the rest will wait
            free_rows = max(self._max_num_seqs - self._stats["running"], 0)
            queued = self._stats["waiting"] + max(self._submitted - free_rows, 0)
            if queued >= self.config.max_queue:
                raise RequestRejected(429, f"The server is at capacity ({queued} requests waiting); retry shortly.",
                                      code="queue_full", retry_after=1)
            self._submitted += 1
        return Admission(self)

    def release_admission(self) -> None:
        """One admitted request left the front door (``Admission.release``)."""
        with self._lock:
            self._submitted -= 1

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       n: int = 1, admission: Admission | None = None, cache_salt: str | None = None,
                       snapshot_at: tuple[int, ...] = ()) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (``n`` choices, told apart by ``index``); the stream ends
        when every choice has had its output with ``finish_reason``. Leaving the loop early (a
        client disconnect cancels it) aborts the request inside the engine.

        ``cache_salt``: the prefix cache serves this request only blocks cached under the same
        salt. ``snapshot_at``: prompt lengths where a whole-row snapshot is worth keeping (the
        end of a chat's system prompt), for models served by the checkpoint tier."""
        if not self.ready.is_set():
            raise EngineNotReady("the model is still loading")
        admission = admission or self.check_admission(len(prompt_ids), params.max_tokens, n)
        rid = RequestId(request_id or uuid.uuid4().hex)
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        requests = [Request(RequestId(rid if i == 0 else f"{rid}-{i}"), list(prompt_ids), _choice_params(params, i),
                            index=i, cache_salt=cache_salt, snapshot_at=tuple(snapshot_at)) for i in range(n)]
        for request in requests:
            self._streams[request.request_id] = (loop, outputs)
        self._inbox.put(lambda engine: self._add(engine, requests, admission))
        open_choices = {r.request_id for r in requests}
        try:
            while open_choices:
                output = await outputs.get()
                if output.finished:
                    open_choices.discard(output.request_id)
                yield output
        finally:
            for request in requests:
                self._streams.pop(request.request_id, None)
            if open_choices:
                self.abort(rid)

    def _add(self, engine: Any, requests: list[Request], admission: Admission) -> list[RequestOutput]:
        try:
            engine.add_request(requests[0], tuple(requests[1:]))
        except ValueError as exc:  # too large for the budget (raced a budget check) or a duplicate id
            return [RequestOutput(r.request_id, "", (), (), r.num_prompt_tokens, 0, FinishReason.ERROR, str(exc),
                                  index=r.index) for r in requests]
        finally:  # from here the engine's own queues count the request
            self._update_stats(engine)
            admission.release()
        return []

    async def cache_stats(self) -> dict[str, Any]:
        """The prefix cache's counters and sizes (``GET /v1/cache/stats``), read on the engine thread."""
        return await self._call(lambda engine: engine.prefix_cache_stats())

    async def reset_cache(self) -> dict[str, Any]:
        """Drop every cached block and snapshot, in memory and on disk (``POST /v1/cache/reset``);
        running requests keep their rows. Returns what was released."""
        return await self._call(lambda engine: engine.reset_prefix_cache())

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        if not self.ready.is_set() or self.info is None:
            raise EngineNotReady("the model is still loading")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def command(engine: Any) -> list[RequestOutput]:
            try:
                result = fn(engine)
            except Exception as exc:  # handed to the caller, never raised on the engine thread
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)
            return []

        self._inbox.put(command)
        return await future

    def abort(self, request_id: str) -> None:
        self._inbox.put(lambda engine: self._abort(engine, RequestId(request_id)))

    def fail_all(self, error: str) -> None:
        """End every request in the engine with ``error`` (a drain that ran out of time)."""
        self._inbox.put(lambda engine: engine.fail_all(error))

    @staticmethod
    def _abort(engine: Any, request_id: RequestId) -> list[RequestOutput]:
        """Abort all choices of a request (forks not yet made go with their parent)."""
        outputs = engine.abort_request(request_id)
        prefix = request_id + "-"
        for other in [r for r in engine.requests if r.startswith(prefix) and r[len(prefix):].isdigit()]:
            outputs += engine.abort_request(other)
        return outputs

    # --- the engine thread ---
    def _main(self) -> None:
        engine = None
        try:
            from engine.engine import make_engine
            from engine.loader import load_model

            loaded = load_model(self.config.model_path, self.config.dtype, self.config.model_id)
            kv, chosen = self.config.kv, None
            if kv.scheme == "auto":  # the layout kvarn advise recommends for this model
                from engine.advise import START_UP, auto_layout

                window = kv.max_kv_size
                kv, chosen = auto_layout(loaded, config=replace(START_UP, num_prompts=kv.advise_prompts,
                                                                gen_tokens=kv.advise_tokens))
                kv = replace(kv, max_kv_size=window)  # the advice picks the layout; the window stays the flag's
                logger.info("KV layout by kvarn advise: %s (%s)", chosen["arm"], chosen["source"])
            engine = make_engine(loaded, self.config.scheduler, kv, self.config.apc, self.config.speculative)
            from engine.warm_up import on_gpu, warm_up

            if self.config.warm_up or (self.config.warm_up is None and on_gpu()):
                report = warm_up(engine)
                logger.info("warm-up: %s", report.as_dict() if report.ran else f"skipped ({report.reason})")
            self._tokenizer = loaded.tokenizer
            self._compiler = ConstraintCompiler(loaded.tokenizer, loaded.vocab_size)
            self._cost, self._budget = engine.cost_alone, engine.kv_budget_bytes
            logger.info("KV layout %s; KV budget %s bytes (%.1f MiB); a full-context sequence costs %s bytes",
                        engine.layout.name, f"{self._budget:,}", self._budget / 2**20,
                        f"{engine.pricing.sequence_bytes(loaded.context_length):,}")
            kv_cache = engine.describe_kv() | ({"layout_choice": chosen} if chosen else {})
            self.info = ModelInfo(loaded.model_id, loaded.context_length, loaded.fingerprint,
                                  loaded.compute_dtype, kv_cache, loaded.vocab_size, chat_format_of(loaded.tokenizer),
                                  max_token_chars(loaded.tokenizer), engine.describe_speculative())
            self._update_stats(engine)  # gauges (budgets, prefix cache) are right before any request
        except BaseException as exc:  # reported through /health; the server stays up to say so
            logger.exception("model load failed")
            if engine is not None:  # made, then a later start-up step failed: its sockets and threads go
                engine.close()
            self.load_error = exc
            self.ready.set()
            return
        self.ready.set()
        try:
            while not self._stop.is_set():
                self._run_commands(engine, block=not engine.has_work())
                if engine.has_work():
                    self._step(engine)
        finally:
            engine.close()  # the prefix cache's queued disk writes, and their KV events, land before the process ends

    def _run_commands(self, engine: Any, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            if block and self._used:  # idle for _IDLE_WAIT_S after work: give its memory back
                self._used = False
                engine.release_idle_memory()
                self._update_stats(engine)
            return
        self._used = True
        while True:
            self._dispatch(command(engine) or ())
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._update_stats(engine)

    def _step(self, engine: Any) -> None:
        self._used = True
        try:
            outputs = engine.step()
        except Exception:  # the runner already isolates row failures; this is a last resort
            logger.exception("engine step failed; aborting its requests")
            outputs = [o for rid in list(engine.requests) for o in engine.abort_request(rid)]
        self._update_stats(engine)  # before the outputs go out: a client that got its last token reads gauges without it
        self._dispatch(outputs)

    def _update_stats(self, engine: Any) -> None:
        stats = {"running": engine.num_running, "waiting": engine.num_waiting,
                 "kv_bytes": engine.runner.kv_nbytes(), "reserved_bytes": engine.scheduler.reserved_bytes,
                 "kv_allocated_bytes": engine.runner.kv_allocated_bytes(),
                 "prefill_forwards": engine.runner.prefill_forwards, "prefill_chunks": engine.runner.prefill_chunks,
                 **mlx_memory(), **engine.prefix_cache_counters(), **engine.speculative_counters()}
        with self._lock:
            self._stats = stats

    def _dispatch(self, outputs: Iterable[RequestOutput]) -> None:
        """Each output onto its request's asyncio queue: one ``call_soon_threadsafe`` a loop for all
        of them (each call writes to the loop's wake-up socket: one a row took 6% of the engine
        thread's time at 16 streams on the CPU)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for outputs, output in items:
        outputs.put_nowait(output)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller went away
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def max_token_chars(tokenizer: Any) -> int:
    """The most characters any one token of ``tokenizer`` decodes to, plus one for a leading
    space that decoding a token alone may drop (SentencePiece): a text of more than
    ``n * max_token_chars`` characters has more than ``n`` tokens. 0 if the vocabulary cannot
    be read (no bound)."""
    try:
        ids = tokenizer.get_vocab().values()
        return max((len(tokenizer.decode([i])) for i in ids), default=-1) + 1
    except Exception:  # noqa: BLE001 - a bound only: without it every prompt is tokenized
        logger.warning("the vocabulary could not be read; no length bound before tokenizing", exc_info=True)
        return 0


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of ``n``: a seeded request seeds choice i with seed + i, so every choice
    is reproducible and the choices differ."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + index)
