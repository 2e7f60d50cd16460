"""``kvarn bench``: prefill and decode tokens/s of the real engine path on one model.

Prefill: time to the first token of a prompt of ``prefill_tokens`` tokens (chunked as the
server does). Decode at depth d: a prompt of d tokens, then ``decode_tokens`` tokens with EOS
ignored; the rate counts tokens after the first over the time after the first. Prompts are
fixed pseudo-random token ids (speed does not depend on content).
"""

from __future__ import annotations

import platform
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx

from engine.engine import Engine, make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.loader import LoadedModel
from engine.request import Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig

_FIRST_ORDINARY_TOKEN = 16


@dataclass(frozen=True)
class BenchConfig:
    prefill_tokens: int = 512
    depths: tuple[int, ...] = (0, 1024, 4096)
    decode_tokens: int = 64
    repeats: int = 2
    seed: int = 0


@dataclass
class BenchReport:
    model: str
    compute_dtype: str
    kv_cache: dict[str, Any]
    device: str
    openblas: bool
    prefill: dict[str, float] = field(default_factory=dict)
    decode: list[dict[str, float]] = field(default_factory=list)
    concurrency: list[dict[str, float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self) -> str:
        kv = self.kv_cache
        layout = kv["scheme"] if kv["scheme"] == "fp16" else f"{kv['scheme']} k{kv['key_bits']}v{kv['value_bits']}"
        head = (f"model `{self.model}`, compute {self.compute_dtype}, KV {layout} ({kv['dtype']}), "
                f"device {self.device}, OpenBLAS {'on' if self.openblas else 'off'}")
        if self.concurrency:
            rows = [f"| {int(c['concurrency'])} | {c['tokens_per_s']:.1f} | {c['decode_tokens_per_s']:.1f} | "
                    f"{c['mean_ttft_s']:.2f} | {c['peak_kv_bytes'] / 2**20:.1f} |" for c in self.concurrency]
            return "\n".join([head, "", "| concurrency | aggregate tok/s | decode-phase tok/s | mean TTFT s | "
                                        "peak KV MiB |", "|---|---|---|---|---|", *rows]) + "\n"
        rows = [f"| prefill {int(self.prefill['tokens'])} tokens | {self.prefill['tokens_per_s']:.1f} tok/s |"]
        rows += [f"| decode at depth {int(d['depth'])} | {d['tokens_per_s']:.1f} tok/s |" for d in self.decode]
        return "\n".join([head, "", "| measurement | rate |", "|---|---|", *rows]) + "\n"


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(max(length, 1))]


def _timed_request(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """Run one request alone; return (time to first token, time after it, tokens after it)."""
    request = Request(RequestId(f"bench-{time.monotonic_ns()}"), prompt,
                      SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    engine.add_request(request)
    start = time.perf_counter()
    first = None
    while engine.has_work():
        engine.step()
        if first is None and request.output_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - start, end - first, len(request.output_ids) - 1


def run_bench(loaded: LoadedModel, config: BenchConfig, openblas: bool, kv: KVConfig | None = None,
              progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    # the prefix cache off: every timed prompt is computed (prefix reuse has its own bench, bench/apc.py)
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=1), kv, ApcConfig(enabled=False))
    rng = random.Random(config.seed)
    report = BenchReport(loaded.model_id, loaded.compute_dtype, engine.describe_kv(),
                         f"{mx.default_device()} ({platform.machine()})", openblas)
    _timed_request(engine, _prompt(rng, 64, loaded.vocab_size), 4)  # warm-up
    best = min(_timed_request(engine, _prompt(rng, config.prefill_tokens, loaded.vocab_size), 1)[0]
               for _ in range(config.repeats))
    report.prefill = {"tokens": config.prefill_tokens, "seconds": best, "tokens_per_s": config.prefill_tokens / best}
    progress(f"prefill {config.prefill_tokens}: {report.prefill['tokens_per_s']:.1f} tok/s")
    for depth in config.depths:
        depth = min(depth, loaded.context_length - config.decode_tokens - 1)
        runs = [_timed_request(engine, _prompt(rng, depth, loaded.vocab_size), config.decode_tokens)
                for _ in range(config.repeats)]
        _, seconds, tokens = min(runs, key=lambda r: r[1] / max(r[2], 1))
        report.decode.append({"depth": max(depth, 1), "tokens": tokens, "seconds": seconds,
                              "tokens_per_s": tokens / seconds})
        progress(f"decode at depth {depth}: {tokens / seconds:.1f} tok/s")
    return report


def _concurrent_level(engine: Engine, rng: random.Random, level: int, prompt_tokens: int, max_tokens: int,
                      vocab_size: int) -> dict[str, float]:
    """``level`` requests arriving together; aggregate generated tokens over the wall time, and
    the decode-phase rate (once every prompt is in, all rows decoding in one batch)."""
    requests = [Request(RequestId(f"c{level}-{i}-{time.monotonic_ns()}"), _prompt(rng, prompt_tokens, vocab_size),
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                for i in range(level)]
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    first: dict[str, float] = {}
    all_in = None
    tokens_at_all_in = 0
    peak = 0
    while engine.has_work():
        engine.step()
        now = time.perf_counter()
        peak = max(peak, engine.runner.kv_nbytes())
        for request in requests:
            if request.output_ids and request.request_id not in first:
                first[request.request_id] = now - start
        if all_in is None and len(first) == level:
            all_in, tokens_at_all_in = now, sum(len(r.output_ids) for r in requests)
    end = time.perf_counter()
    total = sum(len(r.output_ids) for r in requests)
    decode_seconds = end - all_in if all_in is not None else 0.0
    return {"concurrency": level, "requests": level, "prompt_tokens": prompt_tokens, "tokens": total,
            "seconds": end - start, "tokens_per_s": total / (end - start),
            "decode_tokens_per_s": (total - tokens_at_all_in) / decode_seconds if decode_seconds > 0 else 0.0,
            "mean_ttft_s": sum(first.values()) / max(len(first), 1), "peak_kv_bytes": peak}


def run_concurrency_bench(loaded: LoadedModel, levels: tuple[int, ...], prompt_tokens: int, decode_tokens: int,
                          openblas: bool, kv: KVConfig | None = None,
                          progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """Aggregate tokens/s of ``level`` simultaneous requests through the real engine (continuous
    batching, chunked prefill, admission), for each level."""
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=max(levels),
                                                 max_num_batched_tokens=max(1024, max(levels) + 512)),
                         kv, ApcConfig(enabled=False))
    rng = random.Random(0)
    report = BenchReport(loaded.model_id, loaded.compute_dtype, engine.describe_kv(),
                         f"{mx.default_device()} ({platform.machine()})", openblas)
    _concurrent_level(engine, rng, 2, 32, 4, loaded.vocab_size)  # warm-up
    for level in levels:
        row = _concurrent_level(engine, rng, level, prompt_tokens, decode_tokens, loaded.vocab_size)
        report.concurrency.append(row)
        progress(f"concurrency {level}: {row['tokens_per_s']:.1f} tok/s")
    return report
