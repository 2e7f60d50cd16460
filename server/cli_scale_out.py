"""``kvarn serve``'s flags for replicas behind a router (docs/scale-out.md): the KV events a
cache-aware router reads and the graceful drain, and their checks (no MLX imported here: the
``kvarn`` command parses its flags before the OpenBLAS re-exec)."""

from __future__ import annotations

import argparse


def add_scale_out_args(serve: argparse.ArgumentParser) -> None:
    out = serve.add_argument_group(
        "replicas behind a router (docs/scale-out.md)",
        "KV events in vLLM's format tell a cache-aware router (vllm-router kv_aware, llm-d, Dynamo) what "
        "this replica's prefix cache holds; replicas sharing --apc-disk-dir serve each other's blocks.")
    out.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ",
                     help="publish the prefix cache's changes on this ZMQ PUB endpoint, bound here, e.g. "
                          "tcp://*:5557 or tcp://127.0.0.1:5557 (default: off: no socket is opened)")
    out.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ",
                     help="a ROUTER endpoint answering a subscriber that missed events with the recent "
                          "batches from a sequence number on (default: none)")
    out.add_argument("--kv-events-topic", default="", help="the topic frame of every event message (default: '')")
    out.add_argument("--kv-events-block-size", type=int, default=16, metavar="N",
                     help="the router's block size: each cached block is published as blocks of N tokens with "
                          "hashes of their own; N divides the cache's block size (default: %(default)s, "
                          "vLLM's and vllm-router's)")
    out.add_argument("--kv-events-layout", choices=("array", "map"), default="array",
                     help="each event as a msgpack array (vLLM's published subscriber example) or as a map "
                          "tagged by 'type' (later vLLM releases; vllm-router's kv_aware reads only this) "
                          "(default: %(default)s)")
    out.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="on SIGTERM, stop taking requests (503, /health 'draining') and wait this long for "
                          "those in flight before ending them with an error (default: %(default)s)")


def with_kv_events(apc, args: argparse.Namespace):  # engine.ApcConfig -> engine.ApcConfig
    """The prefix cache's settings ``apc`` with the KV events of the flags: the publisher is built
    with the cache (``apc.reuse.make_prefix_reuse``)."""
    from dataclasses import replace

    return replace(apc, kv_events=kv_events_config(args))


def kv_events_config(args: argparse.Namespace):  # -> engine.KVEventsConfig | None
    endpoint, replay = args.kv_events_endpoint, args.kv_events_replay_endpoint
    if endpoint is None:
        if replay is not None:
            raise SystemExit("kvarn serve: --kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    if args.no_apc:
        raise SystemExit("kvarn serve: KV events report the prefix cache's contents; drop --no-apc")
    if args.kv_events_block_size < 1:
        raise SystemExit("kvarn serve: --kv-events-block-size must be >= 1")
    if args.kv_tile % args.kv_events_block_size:
        raise SystemExit(f"kvarn serve: --kv-events-block-size must divide the cache's block size {args.kv_tile}")
    from engine import KVEventsConfig

    try:
        return KVEventsConfig(endpoint, replay, args.kv_events_topic, args.kv_events_block_size,
                              layout=args.kv_events_layout)
    except ValueError as exc:
        raise SystemExit(f"kvarn serve: {exc}") from None
