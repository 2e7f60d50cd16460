"""lm-eval's own ``local-completions`` client through ``kvarn serve``: ``bench/lm_eval_check.py``
runs the three local tasks of ``bench/lm_eval_task`` (multiple choice, rolling log-likelihood, generation
until a newline) against an fp16-KV server and a KVarN server, and checks every log-likelihood lm-eval
got against mlx-lm's in-process forward on the bundled model (~50 s on 2 CPU cores)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import REPO_ROOT, server_env

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="lm-eval is not installed (pip install -e '.[test]' installs lm-eval[api]==0.4.13)")


def test_lm_eval_loglikelihoods_match_mlx_lm(tmp_path: Path):
    report_path = tmp_path / "lm_eval.json"
    proc = subprocess.run([sys.executable, "bench/lm_eval_check.py", "--json", str(report_path)], cwd=REPO_ROOT,
                          env=server_env(), capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    report = json.loads(report_path.read_text())
    assert report["failures"] == []
    fp16, kvarn = report["arms"]
    assert (fp16["arm"], kvarn["arm"]) == ("fp16", "kvarn")
    for arm in (fp16, kvarn):
        assert arm["problems"] == []
        # 24 questions x 4 choices at two prompts a request, 12 texts of one window, 13 generations
        assert arm["requests"] == {"loglikelihood": 60, "generate": 7}
        assert arm["mc_sample"]["n"] == 96 and arm["rolling_sample"]["n"] == 12 and arm["gen"]["n"] == 13
        assert arm["token"]["n"] > 1000
    # unquantized KV: lm-eval's numbers are mlx-lm's to 1e-4 (measured: identical)
    assert fp16["token"]["max_abs"] <= 1e-4 and fp16["sample"]["max_abs"] <= 1e-4
    assert fp16["mc"]["answer_differs"] == 0 and fp16["is_greedy_mismatch"] == 0
    assert fp16["gen"]["same_text"] + fp16["gen"]["near_tie"] == 13  # mlx-lm's greedy text
    # KVarN k4v2: close, not equal (measured: per-token max 0.005, mean 5e-4; no answer changed)
    assert 0 < kvarn["token"]["max_abs"] < 0.1 and kvarn["token"]["mean_abs"] < 0.01
    assert kvarn["mc"]["answer_differs"] <= 2
