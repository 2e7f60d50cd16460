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
    ("serve", ["--host", "--port", "--api-key", "--dtype", "--no-openblas", "--served-model-name", "--allowed-host",
               "--kv-budget-bytes", "--max-queue", "--max-num-seqs", "--no-batch-prefill", "--keep-billing-header",
               "--responses-store-bytes", "--responses-store-dir", "--kv-events-endpoint", "--kv-events-layout",
               "--drain-timeout"]),
    ("run", ["--prompt", "--max-tokens", "--temperature", "--raw", "--system", "--seed"]),
    ("bench", ["--prefill-tokens", "--depths", "--decode-tokens", "--json", "--markdown", "--repeats",
               "--concurrency", "--concurrency-prompt-tokens"]),
])
def test_help_lists_every_flag(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert [f for f in flags if f not in text] == []


def test_kv_events_layout_reaches_the_publisher_config():
    from server.cli_scale_out import kv_events_config as _kv_events_config

    args = build_parser().parse_args(["serve", "--kv-events-endpoint", "tcp://127.0.0.1:5557",
                                      "--kv-events-layout", "map"])
    assert _kv_events_config(args).layout == "map"
    args = build_parser().parse_args(["serve", "--kv-events-endpoint", "tcp://127.0.0.1:5557"])
    assert _kv_events_config(args).layout == "array"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-events-layout", "json"])


def test_kv_events_travel_with_the_prefix_cache_settings():
    from server.cli import server_config

    args = build_parser().parse_args(["serve", "--kv-events-endpoint", "tcp://127.0.0.1:5557",
                                      "--kv-events-block-size", "32", "--apc-memory-bytes", "1MiB"])
    apc = server_config(args).engine.apc
    assert (apc.enabled, apc.memory_bytes, apc.kv_events.endpoint, apc.kv_events.block_size) == (
        True, 2**20, "tcp://127.0.0.1:5557", 32)
    assert server_config(build_parser().parse_args(["serve"])).engine.apc.kv_events is None


@pytest.mark.parametrize("flags,message", [
    (["--no-apc"], "kvarn serve: KV events report the prefix cache's contents; drop --no-apc"),
    (["--kv-events-block-size", "3"], "kvarn serve: --kv-events-block-size must divide the cache's block size 128"),
])
def test_kv_events_refused_at_start_up_with_a_message(flags, message):
    done = kvarn("serve", "--port", "1", "--kv-events-endpoint", "tcp://127.0.0.1:5557", *flags, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr


def test_an_empty_kv_events_endpoint_is_refused():
    with pytest.raises(SystemExit, match="kvarn serve: the KV events endpoint must name a ZMQ endpoint"):
        from server.cli import server_config

        server_config(build_parser().parse_args(["serve", "--kv-events-endpoint", ""]))


def test_run_streams_greedy_answer():
    result = kvarn("run", "--prompt", "What does the ls command do?", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("It is used to list directory contents")


def test_bench_honours_the_kv_flags(tmp_path):
    out_json = tmp_path / "b.json"
    result = kvarn("bench", "--kv-scheme", "affine", "--kv-bits", "8", "--prefill-tokens", "16", "--depths", "0",
                   "--decode-tokens", "2", "--repeats", "1", "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    kv = json.loads(out_json.read_text())["kv_cache"]
    assert (kv["scheme"], kv["key_bits"], kv["value_bits"], kv["group_size"]) == ("affine", 8, 8, 64)


def test_bench_writes_json_and_markdown(tmp_path):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    result = kvarn("bench", "--prefill-tokens", "64", "--depths", "0,128", "--decode-tokens", "8",
                   "--repeats", "1", "--json", str(out_json), "--markdown", str(out_md))
    assert result.returncode == 0, result.stderr
    report = json.loads(out_json.read_text())
    assert report["prefill"]["tokens"] == 64 and report["prefill"]["tokens_per_s"] > 0
    assert [d["depth"] for d in report["decode"]] == [1, 128]
    assert all(d["tokens"] == 7 and d["tokens_per_s"] > 0 for d in report["decode"])
    kv = report["kv_cache"]
    assert (kv["scheme"], kv["key_bits"], kv["value_bits"], kv["tile"]) == ("kvarn", 4, 2, 128)  # the default
    assert "decode at depth 128" in out_md.read_text()


def test_bench_concurrency_reports_every_level(tmp_path):
    out_json = tmp_path / "c.json"
    result = kvarn("bench", "--concurrency", "1,3", "--concurrency-prompt-tokens", "16", "--decode-tokens", "6",
                   "--json", str(out_json))
    assert result.returncode == 0, result.stderr
    levels = json.loads(out_json.read_text())["concurrency"]
    assert [c["concurrency"] for c in levels] == [1, 3]
    assert [c["tokens"] for c in levels] == [6, 18]  # every request generated all its tokens
    assert all(c["tokens_per_s"] > 0 and c["peak_kv_bytes"] > 0 for c in levels)
    assert "| 3 |" in result.stdout


@pytest.mark.parametrize("text,expected", [("536870912", 536870912), ("512MiB", 512 * 2**20), ("2G", 2 * 10**9),
                                           ("1.5GiB", int(1.5 * 2**30)), ("64k", 64000), ("10MB", 10**7)])
def test_kv_budget_sizes(text, expected):
    assert build_parser().parse_args(["serve", "--kv-budget-bytes", text]).kv_budget_bytes == expected


@pytest.mark.parametrize("args", [["--kv-budget-bytes", "lots"], ["--kv-budget-bytes", "5XB"]])
def test_bad_kv_budget_is_refused(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *args])
    assert exit_info.value.code == 2 and "not a size in bytes" in capsys.readouterr().err


def test_serve_refuses_a_step_budget_without_room_for_a_chunk():
    result = kvarn("serve", "--max-num-seqs", "64", "--max-num-batched-tokens", "100", "--no-openblas", timeout=60)
    assert result.returncode != 0 and "max_num_batched_tokens must be >= max_num_seqs + prefill_chunk_size" \
        in result.stderr


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


def test_kld_reports_every_arm(tmp_path):
    # 128 prompt tokens + 160 positions: the sink fills at 128, one record commits at 256
    result = kvarn("kld", "--arms", "kvarn:k8v8,kvarn:k2v2,affine:4", "--prompts", "1", "--prompt-tokens", "128",
                   "--tokens", "160", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "kld.json").read_text())
    arms = {a["arm"]: a for a in report["arms"]}
    assert list(arms) == ["kvarn:k8v8", "kvarn:k2v2", "affine:4"]
    assert 0 < arms["kvarn:k8v8"]["mean_kld"] < arms["kvarn:k2v2"]["mean_kld"]
    assert arms["kvarn:k2v2"]["bytes_per_token"] == 8 * 2 * (4 * 128 / 8 + 12)  # 8 layers, 2 KV heads
    assert arms["affine:4"]["bytes_per_token"] == 8 * 2 * 2 * (128 / 2 + 2 * 2 * 128 / 64)
    assert all(0 <= a["top1_agreement"] <= 1 for a in arms.values())
    assert (tmp_path / "kld.png").read_bytes()[:4] == b"\x89PNG"
    assert "| kvarn:k8v8 |" in (tmp_path / "kld.md").read_text()


@pytest.mark.parametrize("spec,expected", [
    ("fp16", ("fp16", None, None, 128, 64)), ("kvarn:k4v2", ("kvarn", 4, 2, 128, 64)),
    ("kvarn:k3v3:g64", ("kvarn", 3, 3, 64, 64)), ("affine:4", ("affine", 4, 4, 128, 64)),
    ("affine:8:g32", ("affine", 8, 8, 128, 32)),
])
def test_parse_arm(spec, expected):
    from engine.kld import parse_arm

    kv = parse_arm(spec)
    assert (kv.scheme, kv.key_bits, kv.value_bits, kv.tile, kv.group_size) == expected
    assert kv.max_kv_size is None


@pytest.mark.parametrize("spec,window", [("fp16:w512", 512), ("kvarn:k4v2:w1024", 1024), ("kvarn:k3v3:g64:w256", 256),
                                         ("affine:4:w300", 300)])
def test_parse_arm_takes_a_window(spec, window):
    from engine.kld import parse_arm

    assert parse_arm(spec).max_kv_size == window


@pytest.mark.parametrize("spec", ["kvarn", "kvarn:4", "affine:x", "fp16:8", "turbo:k4v2", "fp16:w", "fp16:w8:g64"])
def test_parse_arm_refuses_bad_specs(spec):
    from engine.kld import parse_arm

    with pytest.raises(ValueError):
        parse_arm(spec)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc: subprocess.Popen) -> None:
    import time

    import httpx

    for _ in range(240):
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("kvarn serve did not become healthy")


def test_serve_exits_cleanly_after_serving_and_on_a_busy_port():
    """MLX used from the engine thread used to abort the process at exit ("terminate called without
    an active exception", 134): a server that served KVarN requests exits 0 on SIGINT, and a
    second server on the same port exits 1 with a message, neither aborting."""
    import signal

    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--no-apc"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(port, proc)
        for _ in range(2):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "fixture-chat-29m-q8", "prompt": "The ls command", "max_tokens": 8})
            assert r.status_code == 200
        busy = kvarn("serve", "--port", str(port), "--no-apc", timeout=300)
        assert busy.returncode == 1, busy.stdout + busy.stderr
        assert "could not start" in busy.stderr and "terminate called" not in busy.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-2000:]
    assert "terminate called" not in out


def test_kv_layout_auto_uses_stored_advice_measures_once_per_model_and_reports_it(tmp_path):
    """`--kv-layout auto`: the bundled model's stored advice is used as is (no measurement); another
    model (a copy with another config, so another fingerprint) is measured at start-up and its
    advice stored, which its second start reuses; /v1/models says which layout and where from."""
    import json as _json
    import os
    import shutil
    import signal

    import httpx

    from engine import BUNDLED_MODEL_DIR

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    advise = subprocess.run([sys.executable, "-m", "server.cli", "advise", "--arms", "kvarn:k8v8,kvarn:k2v2",
                             "--prompts", "1", "--prompt-tokens", "300", "--tokens", "12", "--out",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=600, env=env)
    assert advise.returncode == 0, advise.stderr[-2000:]
    stored_arm = _json.loads((tmp_path / "out" / "advice.json").read_text())["arm"]
    other = tmp_path / "other-model"
    shutil.copytree(BUNDLED_MODEL_DIR, other)
    config = _json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(_json.dumps({**config, "rope_theta": 20000.0}))

    def serve(*args: str) -> dict:
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", *args, "--port", str(port), "--no-apc",
                                 "--kv-layout", "auto", "--advise-prompts", "1", "--advise-tokens", "12"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            _wait_healthy(port, proc)
            return httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["kv_cache"]
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)

    bundled = serve()
    assert bundled["layout_choice"]["source"] == "stored advice" and bundled["layout_choice"]["arm"] == stored_arm
    bits = stored_arm.split(":")[1]
    assert f"k{bundled['key_bits']}v{bundled['value_bits']}" == bits
    first = serve(str(other))
    assert first["layout_choice"]["source"].startswith("measured at start-up")
    assert first["layout_choice"]["path"] != bundled["layout_choice"]["path"]  # its own advice
    again = serve(str(other))
    assert again["layout_choice"]["source"] == "stored advice" and again["layout_choice"]["arm"] == first["layout_choice"]["arm"]
    assert len(list((tmp_path / "cache" / "kvarn" / "advice").glob("*.json"))) == 2


@pytest.mark.parametrize("args,message", [
    (["--kv-layout", "kvarn:k4v2", "--kv-bits", "4"], "drop --kv-bits"),
    (["--kv-layout", "turbo"], "--kv-layout: bad arm"),
])
def test_kv_layout_conflicts_and_bad_specs_are_refused(args, message):
    result = kvarn("serve", *args, timeout=60)
    assert result.returncode != 0 and message in result.stderr


# --- --max-kv-size ---

@pytest.mark.parametrize("args,message", [
    (["--max-kv-size", "0"], "must be a positive number of tokens"),
    (["--max-kv-size", "lots"], "not a number of tokens"),
    (["--max-kv-size", "200"], "max_kv_size must be an integer >= 256 for kvarn"),
    (["--kv-tile", "64", "--max-kv-size", "100"], "max_kv_size must be an integer >= 128 for kvarn"),
    (["--kv-scheme", "fp16", "--max-kv-size", "4"], "more than the 4 tokens a rotating cache keeps"),
])
def test_bad_max_kv_size_is_refused_at_start(args, message):
    result = kvarn("serve", *args, timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_max_kv_size_parses_for_serve_run_bench_and_kld():
    parser = build_parser()
    for command in (["serve"], ["run", "--prompt", "x"], ["bench"], ["kld"]):
        assert parser.parse_args([*command, "--max-kv-size", "1024"]).max_kv_size == 1024
        assert parser.parse_args(command).max_kv_size is None
    from server.cli import _kv_config

    kv = _kv_config(parser.parse_args(["serve", "--kv-layout", "kvarn:k4v4", "--max-kv-size", "512"]))
    assert (kv.scheme, kv.key_bits, kv.value_bits, kv.max_kv_size) == ("kvarn", 4, 4, 512)


def test_run_generates_past_a_window():
    result = kvarn("run", "--kv-scheme", "fp16", "--max-kv-size", "16", "--raw", "--prompt", "ls lists files",
                   "--max-tokens", "40")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip()) > 0


def test_kld_reports_window_arms(tmp_path):
    """--max-kv-size windows every arm without a window of its own (named :wN); a 128-token
    prompt and 320 positions run well past a 256-token window."""
    result = kvarn("kld", "--arms", "fp16,kvarn:k4v2,kvarn:k4v4:w384,kvarn:k8v8", "--max-kv-size", "256",
                   "--prompts", "1", "--prompt-tokens", "128", "--tokens", "320", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "kld.json").read_text())
    arms = {a["arm"]: a for a in report["arms"]}
    assert list(arms) == ["fp16:w256", "kvarn:k4v2:w256", "kvarn:k4v4:w384", "kvarn:k8v8:w256"]
    assert report["layouts"]["kvarn:k4v4:w384"]["max_kv_size"] == 384 and report["config"]["max_kv_size"] == 256
    assert arms["fp16:w256"]["mean_kld"] > 0  # the window alone costs something against the whole context
    assert arms["kvarn:k8v8:w256"]["mean_kld"] < arms["kvarn:k4v2:w256"]["mean_kld"]
    assert "`--max-kv-size 256`" in (tmp_path / "kld.md").read_text()
    # a prompt longer than the window prefills window by window, as the engine's rows do
    longer = kvarn("kld", "--arms", "kvarn:k4v2", "--max-kv-size", "256", "--prompts", "1", "--prompt-tokens", "300",
                   "--tokens", "8", "--out", str(tmp_path / "longer"))
    assert longer.returncode == 0, longer.stderr
    (arm,) = json.loads((tmp_path / "longer" / "kld.json").read_text())["arms"]
    assert arm["arm"] == "kvarn:k4v2:w256" and arm["mean_kld"] > 0
