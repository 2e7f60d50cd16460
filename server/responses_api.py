"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter()
