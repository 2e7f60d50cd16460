"""The scale-out benchmark's bookkeeping: the routing trace's own index of kvarn's KV events (it
must see what a router hashing 16-token blocks sees), its parsing of vllm-router's decisions and
its verdicts, and the results file that one invocation per policy adds to."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
import pytest

from apc.events import CacheEvents, make_batch
from apc.hashing import BlockKey

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # after the packages: bench/apc.py is a script
import scale_out  # noqa: E402
from scale_out_trace import EventIndex, Sent, chain_keys, classify, decisions  # noqa: E402

G, B = 128, 16
URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]


def published(tokens: list[int], replica: int, index: EventIndex) -> None:
    """kvarn's events for ``tokens`` cached in blocks of G, as a router's subscriber decodes them."""
    sent: list = []
    events = CacheEvents(sent.append, B, G)
    blocks = [BlockKey(i, bytes([replica, i]) * 8, tuple(tokens[i * G:(i + 1) * G])) for i in range(len(tokens) // G)]
    events.stored(blocks[:1], None, "GPU")
    events.stored(blocks[1:], blocks[0], "GPU")
    payload = msgspec.msgpack.encode(make_batch(sent, layout="map"))
    _, batch, _ = msgspec.msgpack.decode(payload)
    for event in batch:
        index._apply(replica, event, 0.0)


@pytest.fixture
def index():
    index = EventIndex(["inproc://r0", "inproc://r1", "inproc://r2"])  # subscribers that hear nothing
    yield index
    index.close()


def test_the_index_holds_what_kvarn_published_block_for_block(index):
    tokens = list(range(1000, 1000 + 3 * G + 5))
    published(tokens[:3 * G], 1, index)
    assert index.overlaps(chain_keys(tokens)) == [0, 3 * G // B, 0]
    other = tokens[:G] + [7] * (2 * G)  # the first block shared, then other tokens
    assert index.overlaps(chain_keys(other)) == [0, G // B, 0]
    removed = CacheEvents(lambda e: index._apply(1, msgspec.msgpack.decode(msgspec.msgpack.encode(
        make_batch([e], layout="map")))[1][0], 0.0), B, G)
    removed.removed([bytes([1, 1]) * 8], "GPU")  # the second cached block evicted
    assert index.overlaps(chain_keys(tokens)) == [0, G // B, 0]


def test_decisions_are_read_from_the_colored_debug_log(tmp_path):
    log = tmp_path / "router.log"
    log.write_text('\x1b[2m2026\x1b[0m \x1b[34mDEBUG\x1b[0m KV prefix decision \x1b[3moutcome\x1b[0m="prefix_cost" '
                   '\x1b[3mworker\x1b[0m="http://127.0.0.1:2" \x1b[3minput_tokens\x1b[0m=1038 '
                   '\x1b[3mnew_prefill_tokens\x1b[0m=14 \x1b[3mcredited_prefix_tokens\x1b[0m=1024 used_binding=false\n'
                   "INFO another line\n")
    assert decisions(log) == [("http://127.0.0.1:2", 1038, 14, 1024)]


def sent(user: int, tenant: int, start: float, end: float, overlaps: list[int], tokens: int) -> Sent:
    return Sent(user, tenant, 0, tokens, [], start, overlaps, end)


def test_each_decision_gets_its_verdict():
    requests = [sent(0, 0, 0.0, 10.0, [0, 0, 0], 1000),   # cold
                sent(1, 0, 1.0, 11.0, [0, 0, 0], 1001),   # the same tenant still computing on replica 0
                sent(2, 1, 12.0, 13.0, [0, 62, 0], 1002),  # followed the cache
                sent(3, 1, 14.0, 15.0, [64, 0, 0], 1003)]  # went to replica 2 though replica 0 held it
    made = [(URLS[0], 1000, 1000, 0), (URLS[1], 1001, 1001, 0), (URLS[1], 1002, 16, 992), (URLS[2], 1003, 1003, 0)]
    classify(requests, made, URLS)
    assert [r.kind for r in requests] == ["cold", "prefix still computing", "followed the cache", "load over cache"]
    assert [r.replica for r in requests] == [0, 1, 1, 2] and requests[1].in_flight == [1, 0, 0]


def test_results_of_one_policy_per_invocation_add_up_and_another_workload_is_refused():
    run = {"name": "smg cache_aware", "requests": 1}
    before = {"commands": ["a"], "workload": {"tenants": 24}, "runs": [{"name": "smg round_robin"}, run],
              "late_join": {"speedup": 9.0}, "kv_aware_affinity": None}
    now = {"commands": ["b"], "workload": {"tenants": 24}, "runs": [{"name": "smg cache_aware", "requests": 2}],
           "late_join": None, "kv_aware_affinity": None, "sizing": {}, "machine": {}}
    both = scale_out.merged(before, now)
    assert both["commands"] == ["a", "b"] and both["late_join"] == {"speedup": 9.0}
    assert both["runs"] == [{"name": "smg round_robin"}, {"name": "smg cache_aware", "requests": 2}]
    with pytest.raises(SystemExit, match="not the workload"):
        scale_out.merged(before, {**now, "workload": {"tenants": 12}})

