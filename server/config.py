"""Server settings, validated once at start."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from engine import EngineConfig

from server.defaults import API_KEY_ENV, DEFAULT_HOST, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_PORT
from server.response_store import DEFAULT_STORE_BYTES


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """Invariant: a non-loopback bind always has an API key (``validate`` refuses otherwise)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed cross-origin (CORS), "*" for any
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger request bodies get a 413, unread
    reasoning_content: bool = True  # a thinking model's <think> text goes to reasoning_content
    # the Responses API's store (server/response_store.py): its byte bound, and a folder that keeps it across restarts
    responses_store_bytes: int = DEFAULT_STORE_BYTES
    responses_store_dir: str | None = None
    # keep Claude Code's per-conversation "x-anthropic-billing-header:" line in a Messages API
    # system prompt (dropped by default: it changes every conversation and defeats the prefix cache)
    keep_billing_header: bool = False
    # the most tokens a chat-shaped request that sets no cap generates (None: up to the context)
    default_max_tokens: int | None = None

    def validate(self) -> None:
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(
                f"refusing to listen on non-loopback host {self.host!r} without an API key: "
                f"pass --api-key or set {API_KEY_ENV}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError("--default-max-tokens must be at least 1")
        if self.max_request_bytes < 1:
            raise ValueError("--max-request-bytes must be at least 1")
        if self.responses_store_bytes < 0:
            raise ValueError("--responses-store-bytes must be at least 0")

    @staticmethod
    def api_key_from_env() -> str | None:
        return os.environ.get(API_KEY_ENV) or None
