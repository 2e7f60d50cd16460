"""engine/advise.py: the recommendation follows the budget (a synthetic table, exact), the advice
round-trips through its store, and ``kvarn advise`` runs end to end on the bundled model."""

from __future__ import annotations

import json
import subprocess
import sys

from engine.advise import Advice, AdviceConfig, load_stored, recommend, store


def row(arm: str, nbytes: float, kld: float) -> dict:
    return {"arm": arm, "bytes_per_token": nbytes, "mean_kld": kld, "p99_kld": 10 * kld, "top1_agreement": 0.99,
            "compression_vs_fp16": 8192 / nbytes}


TABLE = [row("kvarn:k2v2", 1216, 3.5e-2), row("kvarn:k3v2", 1472, 1.6e-2), row("kvarn:k4v2", 1728, 1.3e-2),
         row("kvarn:k3v3", 1728, 5.6e-3), row("kvarn:k4v3", 1984, 2.7e-3), row("kvarn:k4v4", 2240, 1.0e-3),
         row("affine:4", 2304, 1.8e-2), row("kvarn:k8v8", 4288, 4.3e-6)]


def test_the_fewest_bytes_within_the_budget_and_the_lower_kld_at_equal_bytes():
    assert recommend(TABLE, 1e-2) == ("kvarn:k3v3", True)  # k4v2 has the same bytes but is over
    assert recommend(TABLE, 1.4e-2) == ("kvarn:k3v3", True)  # both within: the lower KLD of equal bytes
    assert recommend(TABLE, 2e-2) == ("kvarn:k3v2", True)
    assert recommend(TABLE, 1e-1) == ("kvarn:k2v2", True)
    assert recommend(TABLE, 5e-3) == ("kvarn:k4v3", True)
    assert recommend(TABLE, 1e-6) == ("kvarn:k8v8", False)  # nothing within: the closest, said so


def test_advice_is_stored_per_model_and_an_unreadable_file_is_ignored(tmp_path):
    advice = Advice("m", "fp-1", AdviceConfig(), TABLE, 8192.0, "kvarn:k3v3", True, 1.5, measured_on="cpu")
    path = store(advice, tmp_path)
    again = load_stored("fp-1", tmp_path)
    assert again == advice and path.name == "fp-1.json"
    assert (again.kv_config().scheme, again.kv_config().key_bits, again.kv_config().value_bits) == ("kvarn", 3, 3)
    assert load_stored("fp-2", tmp_path) is None  # another model has its own advice
    path.write_text("{not json")
    assert load_stored("fp-1", tmp_path) is None


def test_kvarn_advise_runs_on_the_bundled_model(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "server.cli", "advise", "--arms", "kvarn:k8v8,kvarn:k2v2",
                             "--prompts", "1", "--prompt-tokens", "300", "--tokens", "16", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "advice.json").read_text())
    assert [r["arm"] for r in report["rows"]] == ["kvarn:k2v2", "kvarn:k8v8"]  # fewest bytes first
    k2, k8 = report["rows"]
    assert k8["mean_kld"] < k2["mean_kld"] and report["arm"] in ("kvarn:k2v2", "kvarn:k8v8")
    assert (tmp_path / "out" / "advice.png").stat().st_size > 1000 and "recommended" in result.stdout
    stored = list((tmp_path / "cache" / "kvarn" / "advice").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["arm"] == report["arm"]
