"""The app factory. The lifespan starts the engine thread and returns at once: ``/health`` says
503 until the model is loaded.

Middleware, outermost first: the in-flight count (a drain waits for it), the security checks
(Host, Origin, API key), CORS for ``--allowed-origins`` (when any), the request-size limit, then the routes. Prompt building
(chat template, tokenizer) runs on ``app.state.prepare``, a small thread pool, never on the event
loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from engine import EngineClient
from server.config import ServerConfig
from server.drain import CountInFlight, InFlight
from server.errors import install_error_handlers
from server.middleware import BodyLimitMiddleware, SecurityMiddleware
from server.metrics import Metrics
from server.openapi import install_openapi
from server.messages import router as messages_router
from server.responses_api import router as responses_router
from server.routes import router
from server.tokenize import router as tokenize_router

PREPARE_THREADS = 4  # prompts rendered and tokenized at once, beside the engine thread


def create_app(config: ServerConfig, client: EngineClient | None = None) -> FastAPI:
    """An app serving ``config``; pass ``client`` to share an engine (it is then not shut down)."""
    config.validate()
    owned = client is None
    engine_client = client or EngineClient(config.engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="kvarn-prepare")
        if owned:
            engine_client.start()
        try:
            yield
        finally:
            app.state.prepare.shutdown(wait=False, cancel_futures=True)
            if owned:
                engine_client.shutdown()

    app = FastAPI(title="kvarn", version="0.1.0", lifespan=lifespan,
                  description="An OpenAI-compatible LLM server on MLX with the KVarN quantized KV cache. Errors "
                              "are OpenAI's `{\"error\": {message, type, param, code}}`; invalid requests are 400s.")
    app.state.client = engine_client
    app.state.config = config
    app.state.metrics = Metrics(engine_client.stats,
                                lambda: engine_client.info.model_id if engine_client.info else None)
    app.state.in_flight = InFlight()  # what a drain waits for (server/drain.py)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(messages_router)
    app.include_router(responses_router)
    app.include_router(tokenize_router)
    install_openapi(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600)  # the SDK sends headers of its own (x-stainless-*)
    app.add_middleware(SecurityMiddleware, config=config)
    app.add_middleware(CountInFlight, counter=app.state.in_flight)
    return app
