"""The ``kvarn`` command: complete help, one-shot run, bench output files."""

import json
import subprocess
import sys

import pytest

from server.cli import build_parser


def kvarn(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("command,flags", [
    ("serve", ["--host", "--port", "--api-key", "--dtype", "--no-openblas", "--served-model-name", "--allowed-host"]),
    ("run", ["--prompt", "--max-tokens", "--temperature", "--raw", "--system", "--seed"]),
    ("bench", ["--prefill-tokens", "--depths", "--decode-tokens", "--json", "--markdown", "--repeats"]),
])
def test_help_lists_every_flag(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert [f for f in flags if f not in text] == []


def test_run_streams_greedy_answer():
    result = kvarn("run", "--prompt", "What does the ls command do?", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("It is used to list directory contents")


def test_bench_writes_json_and_markdown(tmp_path):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    result = kvarn("bench", "--prefill-tokens", "64", "--depths", "0,128", "--decode-tokens", "8",
                   "--repeats", "1", "--json", str(out_json), "--markdown", str(out_md))
    assert result.returncode == 0, result.stderr
    report = json.loads(out_json.read_text())
    assert report["prefill"]["tokens"] == 64 and report["prefill"]["tokens_per_s"] > 0
    assert [d["depth"] for d in report["decode"]] == [1, 128]
    assert all(d["tokens"] == 7 and d["tokens_per_s"] > 0 for d in report["decode"])
    assert report["kv_cache"]["scheme"] == "fp16"
    assert "decode at depth 128" in out_md.read_text()


def test_cli_module_does_not_import_mlx_before_the_openblas_reexec():
    code = "import sys, server.cli; print('mlx' in sys.modules, 'engine' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["False", "False"]


def test_kvarn_reexecs_with_openblas_when_installed():
    import os

    from server.blas import find_openblas

    lib = find_openblas()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVARN_OPENBLAS_REEXEC")}
    code = ("import sys; from server.cli import main; from server.blas import openblas_active; "
            "sys.argv = ['kvarn', 'run', '--help']; from server.blas import maybe_reexec_with_openblas; "
            "maybe_reexec_with_openblas(); print(openblas_active())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.stdout.strip() == str(lib is not None)
