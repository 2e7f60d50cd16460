"""``bench/greedy_parity.py compare``: identical records pass, a differing token is named by arm,
prompt and position and fails, a missing arm or different prompts fail (plain JSON, no model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "greedy_parity.py"


def _record(arms: dict[str, list[list[int]]], prompts_sha256: str = "p0") -> dict:
    meta = {"revision": "0" * 40, "dirty": False, "model": "m", "compute_dtype": "float32", "tokens": 4,
            "prompt_tokens": [300, 40], "prompts_sha256": prompts_sha256,
            "cached_tokens": {"fp16/apc-hit": [256, 0]}}
    return {"meta": meta, "arms": arms}


BASE_ARMS = {"fp16/no-apc/c1": [[5, 6, 7, 8], [9, 10, 11, 12]], "fp16/apc-hit": [[5, 6, 7, 8], [9, 10, 11, 12]]}


def _compare(tmp_path: Path, base: dict, current: dict) -> tuple[subprocess.CompletedProcess, str]:
    a, b, md = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.md"
    a.write_text(json.dumps(base))
    b.write_text(json.dumps(current))
    proc = subprocess.run([sys.executable, str(SCRIPT), "compare", str(a), str(b), "--md", str(md)],
                          capture_output=True, text=True, timeout=60)
    return proc, md.read_text() if md.exists() else ""


def test_identical_records_exit_0(tmp_path: Path) -> None:
    proc, md = _compare(tmp_path, _record(BASE_ARMS), _record(json.loads(json.dumps(BASE_ARMS))))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["fp16/no-apc/c1: identical (2 prompts)", "fp16/apc-hit: identical (2 prompts)"]
    assert "**identical**" in md and "| fp16/apc-hit | yes | - | 2 / 2 |" in md


@pytest.mark.parametrize(("changed", "position", "expected"), [
    ([9, 10, 99, 12], 2, "prompt 1 at token 2 (11 vs 99)"),
    ([9, 10, 11], 3, "prompt 1 at token 3 (12 vs None)"),  # the current run stopped early
])
def test_a_differing_token_is_named_and_exits_1(tmp_path: Path, changed: list[int], position: int,
                                                expected: str) -> None:
    current = json.loads(json.dumps(BASE_ARMS))
    current["fp16/apc-hit"][1] = changed
    proc, md = _compare(tmp_path, _record(BASE_ARMS), _record(current))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == ["fp16/no-apc/c1: identical (2 prompts)",
                                        f"fp16/apc-hit: DIFFERS in 1 of 2 prompts: {expected}"]
    assert "**DIFFERENT**" in md and f"| fp16/apc-hit | NO | 1: {position} | 2 / 1 |" in md


def test_a_missing_arm_and_other_prompts_exit_1(tmp_path: Path) -> None:
    current = {"fp16/no-apc/c1": BASE_ARMS["fp16/no-apc/c1"]}
    proc, _ = _compare(tmp_path, _record(BASE_ARMS), _record(current, prompts_sha256="p1"))
    assert proc.returncode == 1
    assert proc.stdout.splitlines() == [
        "problem: the prompts' token ids differ (tokenizer or chat template): not like for like",
        "problem: arm fp16/apc-hit only in the base record",
        "fp16/no-apc/c1: identical (2 prompts)",
    ]


def test_a_file_that_is_not_a_record_is_a_clear_error(tmp_path: Path) -> None:
    proc, _ = _compare(tmp_path, {"arms": []}, _record(BASE_ARMS))
    assert proc.returncode == 2
    assert "is not a record (no meta and arms)" in proc.stderr
