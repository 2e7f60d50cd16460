"""Per-scenario results: counts, percentiles, checks; rendered as JSON and as a markdown table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from e2e.client import Outcome


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100); None for no values."""
    data = sorted(values)
    if not data:
        return None
    rank = (len(data) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return data[low] + (data[high] - data[low]) * (rank - low)


@dataclass
class Check:
    """A scenario-level assertion (not tied to one request)."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class ScenarioReport:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    wall_s: float = 0.0

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, ok, detail))
        return ok

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def passed(self) -> bool:
        return not self.failed and all(c.ok for c in self.checks)

    def summary(self) -> dict[str, Any]:
        ttfts = [o.ttft for o in self.outcomes if o.ttft is not None]
        latencies = [o.latency for o in self.outcomes if o.latency is not None and not o.aborted]
        tokens = sum(o.completion_tokens for o in self.outcomes)
        return {
            "name": self.name, "passed": self.passed,
            "requests": len(self.outcomes), "ok": len(self.outcomes) - len(self.failed),
            "failed": len(self.failed), "dropped": sum(o.dropped for o in self.outcomes),
            "aborted": sum(o.aborted and o.ok for o in self.outcomes),
            "output_tokens": tokens, "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s > 0 else None,
            "ttft_p50_s": _round(percentile(ttfts, 50)), "ttft_p95_s": _round(percentile(ttfts, 95)),
            "latency_p50_s": _round(percentile(latencies, 50)), "latency_p95_s": _round(percentile(latencies, 95)),
            "failures": [{"request": o.label, "status": o.status, "reasons": o.reasons} for o in self.failed],
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


_COLUMNS = ("scenario", "result", "requests", "ok", "failed", "dropped", "aborted", "out tok/s",
            "TTFT p50", "TTFT p95", "latency p50", "latency p95", "checks")


def _row(s: dict[str, Any]) -> list[str]:
    checks_ok = sum(c["ok"] for c in s["checks"])
    rate = "-" if s["output_tokens_per_s"] is None else f"{s['output_tokens_per_s']:.1f}"
    return [s["name"], "PASS" if s["passed"] else "FAIL", str(s["requests"]), str(s["ok"]), str(s["failed"]),
            str(s["dropped"]), str(s["aborted"]), rate, _ms(s["ttft_p50_s"]), _ms(s["ttft_p95_s"]),
            _ms(s["latency_p50_s"]), _ms(s["latency_p95_s"]), f"{checks_ok}/{len(s['checks'])}"]


def markdown(report: dict[str, Any]) -> str:
    """The whole run as a markdown table, then every failure and failed check."""
    kv = report.get("kv_cache") or {}
    lines = [f"## kvarn stress: {report['model']} at {report['base_url']}", "",
             f"KV cache: scheme `{kv.get('scheme')}`, key/value bits {kv.get('key_bits')}/{kv.get('value_bits')}, "
             f"dtype `{kv.get('dtype')}`, stamp `{kv.get('stamp')}`; decode attention "
             f"`{report.get('attention') or 'not reported'}`", "",
             "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_row(s)) + " |" for s in report["scenarios"]]
    problems = []
    for s in report["scenarios"]:
        problems += [f"- {s['name']} / {f['request']}: {'; '.join(f['reasons'])}" for f in s["failures"]]
        problems += [f"- {s['name']} / check `{c['name']}`: {c['detail']}" for c in s["checks"] if not c["ok"]]
    if problems:
        lines += ["", "### Failures", ""] + problems
    lines += ["", f"**{'PASSED' if report['passed'] else 'FAILED'}** (exit code {report['exit_code']})"]
    return "\n".join(lines) + "\n"
