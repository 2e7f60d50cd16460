"""Real agent CLIs against ``kvarn serve``: Claude Code (``claude -p``, Anthropic's Messages API)
and Codex CLI (``codex exec``, OpenAI's Responses API) each complete one turn.

The server runs the long-context copy of the bundled model (``tests/long_context_model.py``):
the CLIs' own system prompts and tool lists are tens of thousands of tokens. Each CLI runs in a
home folder of its own, with update checks and telemetry off, talking to 127.0.0.1 only (the
environment is ``bench/agent_cli_runs.py``'s, shared with the benchmark). A test is skipped
where its CLI is not installed (``npm install -g @anthropic-ai/claude-code`` / ``@openai/codex``).
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.long_context_model import LONG_CONTEXT, make_long_context_model
from tests.server.conftest import REPO_ROOT, Server, served

sys.path.insert(0, str(REPO_ROOT / "bench"))
from agent_cli_runs import CliTurn, claude_env, codex_env, run_claude, run_codex, write_codex_config  # noqa: E402

MODEL_ID = "fixture-chat-29m-q8-64k"
# Claude Code fails a turn whose answer reaches its cap (after a few "resume" requests), so the
# cap leaves the model room to end its answer on its own; Codex sends no cap at all.
MAX_TOKENS = 256
SERVER_MAX_TOKENS = 2048  # for requests that set no cap (Codex's)
TURN_TIMEOUT_S = 900
PROMPT = "Say hello in one short sentence."


@pytest.fixture(scope="module")
def long_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = make_long_context_model(tmp_path_factory.mktemp("model") / MODEL_ID)
    # Codex sends no cap and fails a turn that ends incomplete: the server's default cap leaves the
    # bundled model room to stop on its own, short of running on to the end of its context
    with served(tmp_path_factory, "kvarn-long", str(model_dir), "--default-max-tokens", str(SERVER_MAX_TOKENS)) as srv:
        yield srv


# A CLI fails a turn whose answer reaches its output cap, and the bundled model, sampling at the
# CLIs' default temperature, now and then writes past it: that is the model, not the protocol, so
# such a turn runs again (at most ATTEMPTS times); any other failure fails the test at once.
ATTEMPTS = 3
_CAP_REACHED = re.compile(r"max[_ ]?(output[_ ]?)?tokens|output token maximum", re.IGNORECASE)


def until_the_model_stops(run: Callable[[], CliTurn]) -> CliTurn:
    for _ in range(ATTEMPTS):
        turn = run()
        if turn.exit_code == 0 or not _CAP_REACHED.search(f"{turn.reported} {turn.stderr}"):
            return turn
    return turn


def posts(server: Server, path: str) -> list[int]:
    """Statuses of the server's access-log lines for POSTs to ``path`` (any query string)."""
    pattern = re.compile(rf'"POST {re.escape(path)}(?:\?\S*)? HTTP/1\.1" (\d{{3}})')
    return [int(m[1]) for m in pattern.finditer(server.log())]


@pytest.mark.skipif(shutil.which("claude") is None, reason="Claude Code (`claude`) is not installed")
def test_claude_code_completes_a_turn_over_the_messages_api(long_server: Server, tmp_path: Path):
    (tmp_path / "work").mkdir()
    env = claude_env(tmp_path, long_server.base_url, MODEL_ID, MAX_TOKENS)
    turn = until_the_model_stops(lambda: run_claude(tmp_path / "work", env, PROMPT, MODEL_ID, None, TURN_TIMEOUT_S))
    assert turn.exit_code == 0, (turn.reported, turn.stderr, long_server.log()[-3000:])
    assert turn.text.strip() and turn.reported.get("is_error") is False
    statuses = posts(long_server, "/v1/messages")
    assert statuses and set(statuses) == {200}, statuses
    usage = turn.reported["usage"]  # what kvarn reported, as Claude Code summed it
    prompt = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) + \
        usage.get("cache_creation_input_tokens", 0)
    assert prompt > 1_000 and 0 < usage["output_tokens"] <= MAX_TOKENS * len(statuses)


@pytest.mark.skipif(shutil.which("codex") is None, reason="Codex CLI (`codex`) is not installed")
def test_codex_completes_a_turn_over_the_responses_api(long_server: Server, tmp_path: Path):
    (tmp_path / "work").mkdir()
    write_codex_config(tmp_path / ".codex", long_server.base_url, MODEL_ID, LONG_CONTEXT)
    turn = until_the_model_stops(lambda: run_codex(tmp_path / "work", codex_env(tmp_path), PROMPT, None,
                                                   TURN_TIMEOUT_S))
    assert turn.exit_code == 0, (turn.reported, turn.stderr, long_server.log()[-3000:])
    assert turn.text.strip() and turn.reported["errors"] == []
    statuses = posts(long_server, "/v1/responses")
    assert statuses and set(statuses) == {200}, statuses
    usage = turn.reported["usage"]
    assert 1_000 < usage["input_tokens"] < LONG_CONTEXT and usage["output_tokens"] > 0
