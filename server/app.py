"""The app factory. The lifespan starts the engine thread and returns at once: ``/health`` says
503 until the model is loaded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine import EngineClient
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.metrics import Metrics
from server.routes import router
from server.security import SecurityMiddleware


def create_app(config: ServerConfig, client: EngineClient | None = None) -> FastAPI:
    """An app serving ``config``; pass ``client`` to share an engine (it is then not shut down)."""
    config.validate()
    owned = client is None
    engine_client = client or EngineClient(config.engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if owned:
            engine_client.start()
        yield
        if owned:
            engine_client.shutdown()

    app = FastAPI(title="kvarn", version="0.1.0", lifespan=lifespan)
    app.state.client = engine_client
    app.state.config = config
    app.state.metrics = Metrics(engine_client.stats)
    install_error_handlers(app)
    app.include_router(router)
    app.add_middleware(SecurityMiddleware, config=config)
    return app
