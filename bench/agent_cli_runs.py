"""Claude Code and Codex CLI run non-interactively against a local server, one turn a call.

Each CLI gets a fresh home folder of its own (nothing of the machine's configuration is read or
written), talks to 127.0.0.1 only, and has every update check, telemetry and error report that
its configuration can turn off turned off. The environment is built from scratch rather than
inherited, so no key or base URL from outside reaches the CLI.

    claude -p PROMPT --model ID --max-turns 1 --permission-mode dontAsk --output-format json
           [--resume SESSION]                          -> POST /v1/messages
    codex exec --json --skip-git-repo-check PROMPT     -> POST /v1/responses
    codex exec resume --json --skip-git-repo-check THREAD PROMPT
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

API_KEY = "sk-kvarn-agent-bench"
_BASE_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


@dataclass
class CliTurn:
    """One CLI run: its exit code, the answer text it printed, the session to resume, and what it
    said of itself (the CLI's own usage numbers and errors, from its JSON output)."""

    exit_code: int | None
    text: str
    session_id: str | None
    wall_s: float
    stderr: str = ""
    reported: dict[str, Any] = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        return self.exit_code == 0 and bool(self.text.strip())


def cli_present(name: str) -> bool:
    return shutil.which(name) is not None


def _base_env(home: Path) -> dict[str, str]:
    env = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
               XDG_DATA_HOME=str(home / ".local" / "share"), XDG_STATE_HOME=str(home / ".local" / "state"),
               TERM="dumb", NO_COLOR="1")
    return env


def claude_env(home: Path, base_url: str, model: str, max_output_tokens: int) -> dict[str, str]:
    """Claude Code's environment: every model alias it may use for background calls is the served
    model, and nothing is sent anywhere but ``base_url``."""
    env = _base_env(home)
    env.update(
        ANTHROPIC_BASE_URL=base_url, ANTHROPIC_API_KEY=API_KEY, CLAUDE_CONFIG_DIR=str(home / ".claude"),
        ANTHROPIC_MODEL=model, ANTHROPIC_SMALL_FAST_MODEL=model, ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
        ANTHROPIC_DEFAULT_SONNET_MODEL=model, ANTHROPIC_DEFAULT_OPUS_MODEL=model,
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(max_output_tokens), API_TIMEOUT_MS="1800000",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1", DISABLE_BUG_COMMAND="1", DISABLE_COST_WARNINGS="1",
        DISABLE_NON_ESSENTIAL_MODEL_CALLS="1", CLAUDE_CODE_ENABLE_TELEMETRY="0",
        CLAUDE_CODE_DISABLE_TERMINAL_TITLE="1", CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL="1",
    )
    return env


def run_claude(workdir: Path, env: dict[str, str], prompt: str, model: str, session_id: str | None,
               timeout: float) -> CliTurn:
    """One ``claude -p`` turn (``--resume`` the session of an earlier one when given)."""
    command = ["claude", "-p", prompt, "--model", model, "--max-turns", "1", "--permission-mode", "dontAsk",
               "--output-format", "json", *(["--resume", session_id] if session_id else [])]
    exit_code, stdout, stderr, wall = _run(command, workdir, env, timeout)
    try:
        result = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
    except json.JSONDecodeError:
        result = {"unparsed_stdout": stdout[-4000:]}
    text = result.get("result") if isinstance(result.get("result"), str) and not result.get("is_error") else ""
    reported = {k: result[k] for k in ("is_error", "subtype", "num_turns", "usage", "result", "unparsed_stdout")
                if k in result}
    return CliTurn(exit_code, text or "", result.get("session_id", session_id), wall, stderr[-4000:], reported)


def write_codex_config(codex_home: Path, base_url: str, model: str, context_length: int) -> None:
    """Codex's config.toml: a ``kvarn`` provider on the Responses wire API at ``base_url``, with
    update checks, analytics, feedback, OpenTelemetry and history all off."""
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(f"""\
model = "{model}"
model_provider = "kvarn"
model_context_window = {context_length}
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.kvarn]
name = "kvarn"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "KVARN_API_KEY"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 1800000

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[history]
persistence = "none"
""")


def codex_env(home: Path) -> dict[str, str]:
    env = _base_env(home)
    env.update(CODEX_HOME=str(home / ".codex"), KVARN_API_KEY=API_KEY)
    return env


def run_codex(workdir: Path, env: dict[str, str], prompt: str, thread_id: str | None, timeout: float) -> CliTurn:
    """One ``codex exec`` turn (``exec resume THREAD`` for a later one), its JSONL events read back."""
    resume = ["resume", thread_id] if thread_id else []
    command = ["codex", "exec", *resume, "--json", "--strict-config", "--skip-git-repo-check", prompt]
    exit_code, stdout, stderr, wall = _run(command, workdir, env, timeout)
    texts, errors, usage = [], [], None
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = event.get("type")
        if kind == "thread.started":
            thread_id = event.get("thread_id", thread_id)
        elif kind == "item.completed" and event.get("item", {}).get("type") == "agent_message":
            texts.append(event["item"].get("text", ""))
        elif kind == "turn.completed":
            usage = event.get("usage")
        elif kind in ("turn.failed", "error"):
            errors.append(event)
    reported = {"usage": usage, "errors": errors}
    return CliTurn(exit_code, "\n".join(texts) if not errors else "", thread_id, wall, stderr[-4000:], reported)


def _run(command: list[str], workdir: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str, str, float]:
    started = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout)
        return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return None, out, err + f"\n(timed out after {timeout:.0f} s)", time.monotonic() - started
