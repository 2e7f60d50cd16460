"""An engine made with KV events on: ``make_engine`` builds the publisher with the prefix cache
(events flow from the first step, over real ZMQ), ``Engine.close`` closes it, an engine that
fails to build leaves no socket bound, and a checkpoint-tier model warns and opens none."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import zmq

import engine.engine as engine_module
from apc.events import KVEventsConfig
from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.request import Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from tests.apc.test_events_construction import can_bind, free_endpoint
from tests.engine.test_prefix_cache import tiny

CONFIG = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512, prefill_chunk_size=256,
                         kv_budget_bytes=64 * 2**20)


def run(engine, prompt: list[int]) -> None:
    engine.add_request(Request(RequestId(f"r{time.monotonic_ns()}"), prompt,
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    while engine.has_work():
        engine.step()


def received(sub: zmq.Socket, quiet_s: float = 1.0) -> list:
    """Every event until none came for ``quiet_s`` seconds, decoded as plain msgpack."""
    events = []
    while sub.poll(int(quiet_s * 1000)):
        _, _, payload = sub.recv_multipart()
        events += msgspec.msgpack.decode(payload)[1]
    return events


def test_events_flow_from_the_first_step_and_close_with_the_engine(loaded, tmp_path):
    endpoint = free_endpoint()
    engine = make_engine(loaded, CONFIG, KVConfig("fp16"),
                         ApcConfig(disk_dir=str(tmp_path), kv_events=KVEventsConfig(endpoint)))
    prefix = engine.prefix
    assert prefix.publisher is not None and prefix.cache.events.emit == prefix.publisher.emit
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.5)  # a PUB drops what it sends before the subscription reaches it
        prompt = list(range(500, 800))  # two whole blocks of 128
        run(engine, prompt)
        engine.prefix.cache.flush()
        events = received(sub)
    finally:
        sub.close(0)
        ctx.term()
    stored = [(e[3], e[6]) for e in events if e[0] == "BlockStored"]  # (token_ids, medium)
    assert stored.count((prompt[:256], "GPU")) == 1
    assert sorted(t for t, medium in stored if medium == "DISK") == [prompt[:128], prompt[128:256]]
    assert not can_bind(endpoint)
    engine.close()
    assert can_bind(endpoint)  # the engine closed its publisher


def test_an_engine_that_fails_to_build_leaves_no_socket_bound(loaded, monkeypatch):
    def failing_runner(*args, **kwargs):
        raise RuntimeError("no runner")

    monkeypatch.setattr(engine_module, "ModelRunner", failing_runner)
    endpoint = free_endpoint()
    with pytest.raises(RuntimeError, match="no runner"):
        make_engine(loaded, CONFIG, KVConfig("fp16"), ApcConfig(kv_events=KVEventsConfig(endpoint)))
    assert can_bind(endpoint)


def test_a_checkpoint_tier_model_warns_and_opens_no_socket(loaded, caplog):
    endpoint = free_endpoint()
    with caplog.at_level(logging.WARNING, logger="apc.reuse"):
        engine = make_engine(tiny(loaded, "gemma3_text"), CONFIG, KVConfig("fp16"),
                             ApcConfig(kv_events=KVEventsConfig(endpoint)))
    assert engine.prefix.tier == "checkpoint"
    assert engine.prefix.publisher is None and engine.prefix.cache.events is None
    assert "KV events: this model's prefix cache keeps whole-row snapshots, not blocks; nothing will be " \
           "published" in caplog.text
    assert can_bind(endpoint)
    engine.close()
