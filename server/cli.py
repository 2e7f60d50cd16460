"""The ``kvarn`` command: ``serve``, ``run``, ``bench``, ``kld``, ``advise`` and ``stress``.

MLX is imported only after the OpenBLAS re-exec (``server.blas``), so every subcommand gets
the fast BLAS on Linux when it is installed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server.blas import maybe_reexec_with_openblas, openblas_active
from server.defaults import API_KEY_ENV, DEFAULT_HOST, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_PORT
from server.cli_args import DTYPES, add_model_args, size_arg, spec_config, window_arg
from server.cli_scale_out import add_scale_out_args, with_kv_events

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvarn", description="OpenAI-compatible LLM server on MLX with the "
                                                               "KVarN quantized KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,run,bench,kld,advise,stress}")

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                           description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health "
                                       "and /metrics.")
    add_model_args(serve)
    serve.add_argument("--host", default=DEFAULT_HOST, help=f"bind address (default {DEFAULT_HOST}); a "
                                                            "non-loopback address requires an API key")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1/* "
                                                       f"(default: ${API_KEY_ENV})")
    serve.add_argument("--served-model-name", default=None, help="model id in the API (default: folder name)")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="extra Host header name accepted on a loopback bind (repeatable; default: loopback "
                            "names only)")
    serve.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGINS",
                       help="browser origins (e.g. http://localhost:3000; comma-separated or repeated; '*' for any) "
                            "allowed to call the API cross-origin: CORS headers and preflights for them, and their "
                            "POSTs pass the Origin check (default: none: a cross-origin POST is refused with 403)")
    serve.add_argument("--max-request-bytes", type=size_arg, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                       help="largest request body (suffixes as --kv-budget-bytes); a larger one is refused with "
                            "413 before it is read (default: %(default)s = 16MiB)")
    serve.add_argument("--max-num-seqs", type=int, default=64,
                       help="most sequences running at once (default: %(default)s)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=1024,
                       help="token budget of one step (default: %(default)s)")
    serve.add_argument("--prefill-chunk-size", type=int, default=512,
                       help="largest prompt chunk per step (default: %(default)s)")
    serve.add_argument("--async-scheduling", action="store_true",
                       help="in steady decode, launch the next step from this step's sampled tokens before "
                            "reading them back, so the host's work overlaps the device's (a row that stops on "
                            "EOS or a stop string runs one token more on the device, dropped; docs/engine.md)")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="build the decode forward in Python at every step instead of replaying graphs "
                            "compiled once per shape bucket with mx.compile (same tokens; docs/engine.md)")
    serve.add_argument("--no-batch-prefill", action="store_true",
                       help="run each prompt chunk in its own forward (by default a step's chunks of similar "
                            "lengths run together, right-padded; docs/engine.md)")
    serve.add_argument("--kv-budget-bytes", type=size_arg, default=None, metavar="BYTES",
                       help="KV cache budget that admission works within (suffixes K/M/G/KiB/MiB/GiB; default: "
                            "half the machine's memory less the weights, printed at start); a request reserves "
                            "the exact bytes of prompt + max_tokens (blocks shared through the prefix cache "
                            "counted once); the prefix cache keeps what running requests leave of it and gives "
                            "it back when a request needs the room")
    serve.add_argument("--warm-up", choices=("auto", "on", "off"), default="auto",
                       help="run a short synthetic workload before serving (a batch of rows decoding and "
                            "committing a tile beside a prompt chunk), so the first users do not wait while a "
                            "GPU backend builds its kernels; auto: on where MLX runs on a GPU (default: "
                            "%(default)s)")
    serve.add_argument("--max-queue", type=int, default=1024,
                       help="requests waiting for admission beyond this are refused with 429 and Retry-After "
                            "(default: %(default)s)")
    apc = serve.add_argument_group(
        "automatic prefix cache",
        "Requests whose prompts share a prefix (a system prompt, a conversation so far, a document) reuse its "
        "KV cache, in whole blocks of tokens, instead of computing it again; usage reports them as "
        "prompt_tokens_details.cached_tokens. A request's cache_salt keeps its blocks to requests with the "
        "same salt.")
    apc.add_argument("--no-apc", action="store_true",
                     help="turn the prefix cache off: every prompt is computed in full")
    apc.add_argument("--apc-memory-bytes", type=size_arg, default=None, metavar="BYTES",
                     help="a cap on what the prefix cache keeps in memory beside running requests (suffixes as "
                          "--kv-budget-bytes); it lives in the KV budget, never added to it (default: no cap: "
                          "whatever running requests leave free)")
    apc.add_argument("--apc-disk-dir", default=None, metavar="DIR",
                     help="also keep cached blocks on disk in DIR (one file per block, owner-only, checked on "
                          "every read): the disk tier survives restarts, so a restarted server serves prefixes "
                          "it cached before (default: memory tier only)")
    apc.add_argument("--apc-disk-bytes", type=size_arg, default=None, metavar="BYTES",
                     help="byte cap of the disk tier in --apc-disk-dir, least recently used blocks removed "
                          "beyond it (default: 4GiB)")
    spec = serve.add_argument_group(
        "speculative decoding",
        "A decoding row proposes tokens, by prompt lookup (an n-gram of its prompt and output seen before) or "
        "from a smaller draft model with the same tokenizer, and verifies them in one forward: greedy output is "
        "the same, sampled output keeps the model's distribution. Prompt lookup pays off for one or a few streams "
        "that repeat their input (code edits, quoting a document); a draft model wherever it agrees with the "
        "model often and costs much less a token. Rows whose drafts keep being rejected stop proposing, and wide "
        "batches do not speculate. A request opts out with \"speculative\": false.")
    spec.add_argument("--speculative", choices=("ngram", "draft"), default=None,
                      help="speculate by prompt lookup (ngram) or with --draft-model (draft) (default: off)")
    spec.add_argument("--draft-model", default=None, metavar="PATH",
                      help="the draft model for --speculative draft: a local mlx-lm model folder with the "
                           "model's tokenizer (checked at start-up)")
    spec.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                      help="most drafted tokens a row verifies in one step; how many it drafts is chosen "
                           "each step from acceptance and verify cost (default: 8 with ngram, 4 with a "
                           "draft model, whose drafts cost a forward each)")
    spec.add_argument("--speculative-ngram-min", type=int, default=2, metavar="N",
                      help="shortest suffix prompt lookup matches (default: %(default)s)")
    spec.add_argument("--speculative-ngram-max", type=int, default=8, metavar="N",
                      help="longest suffix prompt lookup matches (default: %(default)s)")
    spec.add_argument("--speculative-max-batch", type=int, default=8, metavar="ROWS",
                      help="no speculation in a step with more decoding rows than this (default: %(default)s)")
    add_scale_out_args(serve)
    serve.add_argument("--no-reasoning-content", action="store_true",
                       help="leave a thinking model's <think>...</think> text in the chat 'content' instead of "
                            "splitting it out into 'reasoning_content' (models without think tokens: no effect)")
    serve.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                       help="the most tokens a chat, Messages or Responses request that sets no max_tokens "
                            "generates (as mlx_lm.server's --max-tokens; for agent CLIs that send no cap; "
                            "default: up to the model's context)")
    serve.add_argument("--keep-billing-header", action="store_true",
                       help="keep the 'x-anthropic-billing-header:' line Claude Code puts at the top of its system "
                            "prompt on /v1/messages (by default it is dropped: it changes every conversation, so "
                            "no two conversations would share a cached prefix)")
    responses = serve.add_argument_group(
        "Responses API store",
        "POST /v1/responses keeps each response and its conversation (unless the request says store: false), "
        "so GET /v1/responses/{id} returns it and previous_response_id continues it.")
    responses.add_argument("--responses-store-bytes", type=size_arg, default=None, metavar="BYTES",
                           help="byte bound of the stored responses (their JSON text), least recently used "
                                "dropped beyond it (suffixes as --kv-budget-bytes; default: 64MiB; 0 keeps none)")
    responses.add_argument("--responses-store-dir", default=None, metavar="DIR",
                           help="keep the stored responses in DIR, one JSON file each, so they survive a restart "
                                "(default: memory only)")
    serve.add_argument("--parse-special-tokens", action="store_true",
                       help="tokenize special-token text typed inside chat message content (e.g. '<|im_end|>') as "
                            "the model's control tokens; by default it is plain text, so a message cannot forge "
                            "turns")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="(default: %(default)s)")

    run = sub.add_parser("run", help="generate once and stream the text to the terminal",
                         description="One-shot generation without a server.")
    add_model_args(run)
    run.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    run.add_argument("--system", default=None, help="system message (chat mode)")
    run.add_argument("--raw", action="store_true", help="complete the prompt as plain text, no chat template")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)

    bench = sub.add_parser("bench", help="measure prefill and decode tokens/s",
                           description="Prefill tok/s and decode tok/s at several depths through the engine; "
                                       "prints markdown, optionally writes JSON and markdown files.")
    add_model_args(bench)
    bench.add_argument("--prefill-tokens", type=int, default=512)
    bench.add_argument("--depths", default="0,1024,4096",
                       help="comma-separated decode depths (clamped to the context)")
    bench.add_argument("--decode-tokens", type=int, default=64)
    bench.add_argument("--concurrency", default=None, metavar="LEVELS",
                       help="comma-separated concurrency levels (e.g. 1,4,16,64): measure aggregate decode "
                            "tokens/s of that many simultaneous requests instead of the depth sweep")
    bench.add_argument("--concurrency-prompt-tokens", type=int, default=128,
                       help="prompt tokens of each request of a concurrency level")
    bench.add_argument("--repeats", type=int, default=2, help="best of N per measurement")
    bench.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    bench.add_argument("--markdown", type=Path, default=None, help="write the report as markdown here")
    kld = sub.add_parser("kld", help="measure KV-cache fidelity: KL divergence and top-1 agreement vs fp16",
                         description="Teacher-force a greedy fp16 continuation through each KV layout one token "
                                     "at a time; report KLD (mean, median, p99, max), top-1 and greedy "
                                     "agreement, bytes per token; writes kld.md, kld.json and kld.png.")
    kld.add_argument("model", nargs="?", default=None, help="local mlx-lm model folder (default: bundled)")
    kld.add_argument("--dtype", choices=DTYPES, default="auto", help="compute dtype (as for serve)")
    kld.add_argument("--no-openblas", action="store_true", help="do not preload OpenBLAS")
    kld.add_argument("--arms", default=None,
                     help="comma-separated arms: fp16, kvarn:kXvY[:gG], affine:B[:gG], each with an optional "
                          ":wN window (default: kvarn k8v8, "
                          "k4v4, k4v2, k3v3, k2v2 and affine 8 and 4 with group 64)")
    kld.add_argument("--prompts", type=int, default=8, help="number of shipped held-out prompts (max 10)")
    kld.add_argument("--prompt-tokens", type=int, default=256, help="tokens of each prompt")
    kld.add_argument("--tokens", type=int, default=2048, help="decode positions per prompt")
    kld.add_argument("--max-kv-size", type=window_arg, default=None, metavar="N",
                     help="attention window of every arm that names none of its own (an arm's :wN); the "
                          "reference stays unbounded fp16 (default: none)")
    advise = sub.add_parser("advise", help="measure which KV layout to serve this model with",
                            description="Teacher-force the model's own greedy continuations of shipped generic "
                                        "prompts through every candidate layout (KVarN k8v8 ... k2v2, affine 8 "
                                        "and 4); recommend the fewest bytes per token within a mean-KLD budget. "
                                        "Writes advice.md, advice.json and advice.png, and stores the advice for "
                                        "`kvarn serve --kv-layout auto`.")
    advise.add_argument("model", nargs="?", default=None, help="local mlx-lm model folder (default: bundled)")
    advise.add_argument("--max-kld", type=float, default=1e-2,
                        help="budget: the recommended layout's mean KL divergence from fp16, in nats (default: "
                             "%(default)g)")
    advise.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="compute dtype (default: %(default)s, so differences are the layouts' alone)")
    advise.add_argument("--no-openblas", action="store_true", help="do not preload OpenBLAS")
    advise.add_argument("--arms", default=None, help="comma-separated candidates as for `kvarn kld` (default: KVarN "
                                                     "k8v8, k4v4, k4v3, k3v3, k4v2, k3v2, k2v2, affine 8 and 4)")
    advise.add_argument("--prompts", type=int, default=4, help="number of shipped prompts (default: %(default)s)")
    advise.add_argument("--prompt-tokens", type=int, default=256, help="tokens of each prompt (default: %(default)s)")
    advise.add_argument("--tokens", type=int, default=512,
                        help="teacher-forced decode positions per prompt (default: %(default)s)")
    advise.add_argument("--out", type=Path, default=Path("advice-out"), help="report folder (default: %(default)s)")
    advise.add_argument("--no-store", action="store_true",
                        help="do not store the advice for `kvarn serve --kv-layout auto`")
    kld.add_argument("--out", type=Path, default=Path("kld-out"), help="output folder")
    sub.add_parser("stress", add_help=False, help="stress and check a running kvarn server over HTTP (the e2e "
                                                  "runner: kvarn stress --help)")
    for command in (serve, run, bench, kld, advise):
        _show_defaults(command)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help says its default (those that already say it in words are left as they are)."""
    for action in parser._actions:
        if action.required or not action.option_strings or action.nargs == 0 or "default" in (action.help or ""):
            continue
        shown = "none" if action.default is None else "%(default)s"
        action.help = f"{action.help or ''} (default: {shown})".strip()


def main(argv: list[str] | None = None, adjust: Callable[[Any], Any] | None = None) -> int:
    """The ``kvarn`` command. ``adjust``: for code that embeds ``kvarn serve`` (a proposer of its own,
    say), a function given the server's config before the app is made, returning the one to serve."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stress"]:  # a client of a server: its own arguments, no MLX, no OpenBLAS re-exec
        from e2e.stress import main as stress

        return stress(argv[1:], prog="kvarn stress")
    args = build_parser().parse_args(argv)
    maybe_reexec_with_openblas(disabled=args.no_openblas)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve(args, adjust)
    return {"run": _run, "bench": _bench, "kld": _kld, "advise": _advise}[args.command](args)


def _kv_config(args: argparse.Namespace):  # -> engine.KVConfig (imported after the re-exec)
    from dataclasses import replace

    config = _kv_layout_config(args)
    window = getattr(args, "max_kv_size", None)
    if window is None:
        return config
    from engine.kv_config import check_window

    config = replace(config, max_kv_size=window)
    try:
        check_window(config)  # the floor of the scheme's window, before anything loads
    except ValueError as exc:
        raise SystemExit(f"kvarn: --max-kv-size: {exc}") from None
    return config


def _kv_layout_config(args: argparse.Namespace):  # -> engine.KVConfig (imported after the re-exec)
    from engine import KVConfig

    if args.kv_layout is not None:
        flags = [f for f, v, default in (("--kv-scheme", args.kv_scheme, "kvarn"), ("--kv-bits", args.kv_bits, None),
                                         ("--kv-key-bits", args.kv_key_bits, None),
                                         ("--kv-value-bits", args.kv_value_bits, None)) if v != default]
        if flags:
            raise SystemExit(f"kvarn: --kv-layout names the whole layout; drop {', '.join(flags)}")
        if args.kv_layout == "auto":
            if args.command != "serve":
                raise SystemExit("kvarn: --kv-layout auto is for `kvarn serve` (run `kvarn advise` to measure)")
            return KVConfig("auto", advise_prompts=args.advise_prompts, advise_tokens=args.advise_tokens)
        from engine.kld import parse_arm

        try:
            return parse_arm(args.kv_layout)
        except ValueError as exc:
            raise SystemExit(f"kvarn: --kv-layout: {exc}") from None
    key_bits = args.kv_key_bits or args.kv_bits
    value_bits = args.kv_value_bits or args.kv_bits
    if args.kv_scheme == "affine" and key_bits and value_bits and key_bits != value_bits:
        raise SystemExit("kvarn: the affine baseline uses one width for keys and values (--kv-bits)")
    return KVConfig(args.kv_scheme, key_bits, value_bits, args.kv_tile, args.kv_group_size)


def _apc_config(args: argparse.Namespace):  # -> engine.ApcConfig (imported after the re-exec)
    from engine import ApcConfig

    given = [flag for flag, value in (("--apc-memory-bytes", args.apc_memory_bytes),
                                      ("--apc-disk-dir", args.apc_disk_dir),
                                      ("--apc-disk-bytes", args.apc_disk_bytes)) if value is not None]
    if args.no_apc:
        if given:
            raise SystemExit(f"kvarn serve: --no-apc turns the prefix cache off; drop {', '.join(given)}")
        return ApcConfig(enabled=False)
    if args.apc_disk_bytes is not None and args.apc_disk_dir is None:
        raise SystemExit("kvarn serve: --apc-disk-bytes caps the disk tier, which needs --apc-disk-dir")
    if args.apc_disk_bytes is not None and args.apc_disk_bytes <= 0:
        raise SystemExit("kvarn serve: --apc-disk-bytes must be > 0")
    if args.apc_disk_dir is not None and not args.apc_disk_dir.strip():
        raise SystemExit("kvarn serve: --apc-disk-dir must name a folder")
    disk_dir = str(Path(args.apc_disk_dir).expanduser()) if args.apc_disk_dir is not None else None
    if args.apc_disk_bytes is None:
        return ApcConfig(memory_bytes=args.apc_memory_bytes, disk_dir=disk_dir)
    return ApcConfig(memory_bytes=args.apc_memory_bytes, disk_dir=disk_dir, disk_bytes=args.apc_disk_bytes)


def server_config(args: argparse.Namespace):  # -> server.config.ServerConfig
    """The server's and its engine's configuration from ``kvarn serve``'s parsed flags
    (``SystemExit`` with a message for flags that cannot run together)."""
    from engine import EngineConfig, SchedulerConfig
    from server.config import ServerConfig

    try:
        scheduler = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.prefill_chunk_size,
                                    args.kv_budget_bytes, async_scheduling=args.async_scheduling,
                                    batch_prefill=not args.no_batch_prefill, compile_decode=not args.enforce_eager)
    except ValueError as exc:
        raise SystemExit(f"kvarn serve: {exc}") from exc
    if args.max_queue < 0:
        raise SystemExit("kvarn serve: --max-queue must be >= 0")
    return ServerConfig(
        engine=EngineConfig(args.model, args.served_model_name, args.dtype,
                            scheduler, _kv_config(args), apc=with_kv_events(_apc_config(args), args),
                            max_queue=args.max_queue,
                            parse_special=args.parse_special_tokens,
                            warm_up={"auto": None, "on": True, "off": False}[args.warm_up],
                            speculative=spec_config(args)),
        host=args.host, port=args.port, api_key=args.api_key or ServerConfig.api_key_from_env(),
        allowed_hosts=tuple(args.allowed_host), reasoning_content=not args.no_reasoning_content,
        keep_billing_header=args.keep_billing_header, default_max_tokens=args.default_max_tokens,
        allowed_origins=tuple(o.strip() for arg in args.allowed_origins for o in arg.split(",") if o.strip()),
        max_request_bytes=args.max_request_bytes, responses_store_dir=args.responses_store_dir,
        **({} if args.responses_store_bytes is None else {"responses_store_bytes": args.responses_store_bytes}))


def _serve(args: argparse.Namespace, adjust: Callable[[Any], Any] | None = None) -> int:
    import uvicorn

    from server.app import DrainingServer, create_app

    if args.drain_timeout < 0:
        raise SystemExit("kvarn serve: --drain-timeout must be >= 0")
    config = server_config(args)
    if adjust is not None:
        config = adjust(config)
    try:
        app = create_app(config)
    except ValueError as exc:
        logging.getLogger("kvarn").error("%s", exc)
        return 2
    logging.getLogger("kvarn").info("OpenBLAS %s", "on" if openblas_active() else "off")
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level), app,
                            args.drain_timeout)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn's own exit, e.g. the port is taken (it logged why)
        if exc.code in (0, None):
            return 0
        logging.getLogger("kvarn").error("kvarn serve could not start on %s:%s (see the error above)",
                                         args.host, args.port)
        return 1
    if not server.started:
        logging.getLogger("kvarn").error("kvarn serve could not start on %s:%s (see the error above)",
                                         args.host, args.port)
        return 1
    return 0


def _run(args: argparse.Namespace) -> int:
    from engine import ApcConfig, Request, RequestId, SamplingParams, load_model, make_engine

    loaded = load_model(args.model, args.dtype)
    if args.raw:
        prompt = list(loaded.tokenizer.encode(args.prompt, add_special_tokens=False))
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = list(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    max_tokens = min(args.max_tokens, loaded.context_length - len(prompt))
    if max_tokens < 1:
        print(f"kvarn: the prompt ({len(prompt)} tokens) fills the context ({loaded.context_length})",
              file=sys.stderr)
        return 2
    # one request in a process of its own: nothing could ever reuse its blocks
    try:
        engine = make_engine(loaded, kv=_kv_config(args), apc=ApcConfig(enabled=False))
    except ValueError as exc:  # a layout this model cannot run (e.g. a KVarN window on layers of its own)
        print(f"kvarn: {exc}", file=sys.stderr)
        return 2
    engine.add_request(Request(RequestId("run"), prompt, SamplingParams(
        max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)))
    while engine.has_work():
        for output in engine.step():
            sys.stdout.write(output.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine import BenchConfig, load_model, run_bench
    from engine.bench import run_concurrency_bench

    depths = tuple(int(d) for d in args.depths.split(",") if d.strip())
    levels = tuple(int(c) for c in args.concurrency.split(",") if c.strip()) if args.concurrency else ()
    if any(level < 1 for level in levels):
        raise SystemExit("kvarn bench: concurrency levels must be >= 1")
    config = BenchConfig(args.prefill_tokens, depths, args.decode_tokens, args.repeats)
    loaded = load_model(args.model, args.dtype)
    with tqdm(total=len(levels) or 1 + len(depths), desc="kvarn bench", file=sys.stderr) as bar:
        def progress(message: str) -> None:
            bar.set_postfix_str(message)
            bar.update(1)

        if levels:
            report = run_concurrency_bench(loaded, levels, args.concurrency_prompt_tokens, args.decode_tokens,
                                           openblas_active(), _kv_config(args), progress)
        else:
            report = run_bench(loaded, config, openblas_active(), _kv_config(args), progress)
    markdown = report.to_markdown()
    print(markdown)
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown)
    return 0


def _kld(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine import load_model
    from engine.kld import DEFAULT_ARMS, KldConfig, run_kld
    from engine.kld_report import write_reports

    arms = tuple(a.strip() for a in args.arms.split(",")) if args.arms else DEFAULT_ARMS
    config = KldConfig(arms, args.prompts, args.prompt_tokens, args.tokens, args.max_kv_size)
    loaded = load_model(args.model, args.dtype)
    with tqdm(total=config.gen_tokens, desc="kvarn kld", unit="pos", file=sys.stderr) as bar:
        try:
            results, fp16_bytes = run_kld(loaded, config, bar.update)
        except ValueError as exc:  # a bad arm, a window too small for the prompt, a context too short
            raise SystemExit(f"kvarn kld: {exc}") from None
    print(write_reports(args.out, results, fp16_bytes, config, loaded.model_id))
    return 0


def _advise(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine import load_model
    from engine.advise import CANDIDATES, AdviceConfig, advise, store, write_report

    arms = tuple(a.strip() for a in args.arms.split(",")) if args.arms else CANDIDATES
    config = AdviceConfig(max_kld=args.max_kld, arms=arms, num_prompts=args.prompts,
                          prompt_tokens=args.prompt_tokens, gen_tokens=args.tokens)
    loaded = load_model(args.model, args.dtype)
    with tqdm(total=config.gen_tokens, desc="kvarn advise", unit="pos", file=sys.stderr) as bar:
        advice = advise(loaded, config, bar.update)
    print(write_report(args.out, advice))
    if not args.no_store:
        print(f"stored for `kvarn serve --kv-layout auto`: {store(advice)}")
    return 0


def entry() -> None:
    """The ``kvarn`` command (and ``python -m server.cli``): ``main``, then an immediate exit.

    ``kvarn serve`` runs MLX on its engine thread, and MLX (0.32) can abort the process while
    C++ static objects are destroyed at exit after it was used from a thread other than the main
    one ("terminate called without an active exception", exit 134; ml-explore/mlx#3126). By the
    time ``main`` returns, the server has shut down cleanly (the engine thread stopped, the prefix
    cache's disk writes landed), so the process leaves with ``os._exit`` once the logs and
    standard streams are flushed, skipping the static destructors."""
    try:
        code = main()
    except SystemExit as exc:  # argparse's --help and usage errors, start-up errors
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
