"""Speculative decoding in one process on any MLX device (an NVIDIA GPU in docs/benchmarks.md), at the
bundled model and at an 8B shape: bench/speculative.py's table without HTTP, measuring the engine.

    PYTHONPATH=. python3 bench/device_speculative.py --model bundled --out $OUT/speculative-{card}-bundled.json
    PYTHONPATH=. python3 bench/device_speculative.py --model 8b --out $OUT/speculative-{card}-8b.json

``{card}`` in ``--out`` becomes the device's short name (``h100``, ``h200``; ``cpu`` on MLX's CPU).
Models: ``bundled`` (fixture-chat-29m-q8, the server's dtype rule: real acceptance) and ``8b``
(bench/device_engine.py's random-weight Llama: hidden 4096, 32 layers, 32 / 8 heads, head_dim 128,
intermediate 14336, bfloat16, vocab 8192 with the bundled tokenizer; ``--layers/--hidden/--intermediate``
shrink it). Its weights are random, so what it generates (and so prompt lookup's acceptance) says
nothing about a trained model's; the oracle arm gives the verify path's cost and ceiling at that shape.

Arms, each an engine made as ``kvarn serve`` makes it (its flags through server/cli.py's parser, then
``make_engine`` and, on a GPU, engine/warm_up.py), all with ``--no-apc`` and ``--kv-layout`` from
``--layout``: ``off``; ``ngram`` (``--speculative ngram`` with bench/speculative.py's NGRAM_FLAGS);
``oracle`` (``--speculative ngram --num-speculative-tokens 4`` whose proposer replays the greedy
continuation recorded first, in this process, by the ``off`` engine: bench/spec_oracle_server.py's
``ReplayProposer``); ``draft`` (bundled model only: ``--speculative draft`` with bench/speculative.py's
2-layer cut of the bundled model, k = 4).

Scenarios (bench/speculative.py's prompts, greedy): long, c = 1 (one LONG prompt a round) and c = 4
(four a round), ``--max-tokens`` each with ``ignore_eos``; short open chat, c = 1 (four SHORT prompts a
round, ``--short-tokens``, EOS honoured). Per scenario every arm first runs one untimed pass of the
first round's prompts (``--warm-tokens`` each: kernels and verify shapes are built there), then
``--rounds`` rounds, the arms in turn within each round, their order rotating by round. Per arm:
tok/s = generated tokens / wall time of the round (prefill included), median over the rounds; ``x`` =
median of the paired ratios to the same round's ``off``, with their range; acceptance = accepted /
drafted tokens over the timed rounds (the engine's speculation counters); ``same`` = requests whose
tokens equal the recorded greedy ones (a prefix of them where EOS ended the request); per round, the
slowest step and the steps over ``STALL_S`` (``rounds_slowest_step_s``, ``rounds_stalls``: a kernel
or graph built on first use stops the batch).

``--time-budget`` seconds from start: a warm pass or round that its estimate says would not end in
time is not started, and the JSON says what was skipped and why; rounds past the third run only
within the scenario's share of the time left (left / scenarios to go), so every scenario gets its
three. The JSON is rewritten after each scenario; a markdown table is printed at the end. CPU smoke
runs: ``--model bundled --rounds 2 --max-tokens 32 --short-tokens 32 --warm-tokens 16`` and the same
with ``--model 8b --layers 2 --hidden 512 --intermediate 1024``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.blas import maybe_reexec_with_openblas, openblas_active  # noqa: E402

if __name__ == "__main__":
    maybe_reexec_with_openblas()  # before MLX is imported: float32 on the CPU needs OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench.device_engine import Recorder, build_model, elapsed, environment, log  # noqa: E402
from bench.spec_oracle_server import ReplayProposer  # noqa: E402
from bench.speculative import DRAFT_LAYERS, LONG, NGRAM_FLAGS, SHORT, greedy_book  # noqa: E402
from engine.chat_format import chat_prompt_ids  # noqa: E402
from engine.engine import make_engine  # noqa: E402
from engine.loader import BUNDLED_MODEL_DIR, load_model  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.warm_up import on_gpu, warm_up  # noqa: E402
from server.cli import server_config, build_parser  # noqa: E402

ARMS = ("off", "ngram", "oracle", "draft")
ORACLE_K = 4
RESERVE_S = 5.0  # kept back from the budget to write the report
MIN_ROUNDS = 3  # rounds a scenario may run past its share of the time left (not past the budget)
STALL_S = 0.25  # a step this long is a stall here (an 8B step takes ~10 ms on an H100)


@dataclass(frozen=True)
class Scenario:
    key: str
    name: str
    concurrency: int
    prompts: tuple[str, ...]
    per_round: int
    max_tokens: int
    ignore_eos: bool

    def round_prompts(self, r: int) -> list[str]:
        """Round ``r``'s prompts: the next ``per_round`` of the list, wrapping around."""
        return [self.prompts[(r * self.per_round + i) % len(self.prompts)] for i in range(self.per_round)]


def make_scenarios(args) -> list[Scenario]:
    every = [Scenario("long-c1", "long greedy, c=1", 1, tuple(LONG), 1, args.max_tokens, True),
             Scenario("long-c4", "long greedy, c=4", 4, tuple(LONG), 4, args.max_tokens, True),
             Scenario("short-c1", "short open chat, c=1", 1, tuple(SHORT), 4, args.short_tokens, False)]
    keys = [k.strip() for k in args.scenarios.split(",") if k.strip()]
    unknown = set(keys) - {s.key for s in every}
    if unknown or not keys:
        raise SystemExit(f"--scenarios: any of {', '.join(s.key for s in every)} (not {sorted(unknown)})")
    return [s for s in every if s.key in keys]


def card_name() -> str:
    """The device's short name for result files: ``cpu``, else the GPU's model (``h100``, ``gh200``)."""
    if not on_gpu():
        return "cpu"
    match = re.search(r"\b([A-Z]+\d{3}[A-Z]?)\b", str(mx.device_info().get("device_name", "")).upper())
    return match.group(1).lower() if match else "gpu"


# --- engines, as the server makes them ------------------------------------------------------------

def serve_flags(arm: str, layout: str, draft_dir: Path | None) -> list[str]:
    """The ``kvarn serve`` flags of an arm (``layout``: ``kvarn-k4v2``, ``fp16``, ``affine-4``)."""
    flags = ["serve", "--no-apc", "--kv-layout", layout.replace("-", ":", 1)]
    if arm == "ngram":
        return flags + ["--speculative", "ngram", *NGRAM_FLAGS]
    if arm == "oracle":
        return flags + ["--speculative", "ngram", "--num-speculative-tokens", str(ORACLE_K)]
    if arm == "draft":
        return flags + ["--speculative", "draft", "--draft-model", str(draft_dir)]
    return flags


def engine_config(flags: list[str]):  # -> engine.EngineConfig
    """The engine settings ``kvarn serve FLAGS`` would run with (server/cli.py)."""
    return server_config(build_parser().parse_args(flags)).engine


def make_arm(loaded, arm: str, flags: list[str], book: list[dict] | None) -> tuple[Any, dict]:
    """(engine, what it is): the server's ``make_engine`` call and, on a GPU, its warm-up."""
    config = engine_config(flags)
    spec = config.speculative
    if arm == "oracle":
        spec = replace(spec, proposer=ReplayProposer.from_entries(book or []))
    t0 = time.perf_counter()
    engine = make_engine(loaded, config.scheduler, config.kv, config.apc, spec)
    info: dict[str, Any] = {"flags": flags[1:], "make_engine_s": round(time.perf_counter() - t0, 3),
                            "speculative": engine.describe_speculative(), "kv": engine.layout.name}
    if config.warm_up or (config.warm_up is None and on_gpu()):
        info["warm_up"] = warm_up(engine).as_dict()
    return engine, info


def load(args):  # -> engine.LoadedModel
    if args.model == "bundled":
        return load_model(None, args.dtype or "auto")
    shape = SimpleNamespace(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
                            dtype=args.dtype or "bfloat16")
    return build_model(shape, Recorder())[0]


# --- rounds -----------------------------------------------------------------------------------------

class ArmFailed(RuntimeError):
    """A round of one arm raised: the arm is dropped, the report says why."""

    def __init__(self, arm: str, exc: BaseException) -> None:
        super().__init__(f"{arm}: {type(exc).__name__}: {exc}")
        self.arm = arm


@dataclass
class RoundResult:
    tokens: int
    wall: float
    same: int  # requests whose tokens equal the recorded greedy ones
    slowest_step: float = 0.0  # seconds
    stalls: int = 0  # steps over STALL_S (a kernel or graph built on first use stops the batch)


def run_round(engine, prompts: list[list[int]], s: Scenario, max_tokens: int, tag: str,
              book: dict[tuple[int, ...], list[int]]) -> RoundResult:
    """``prompts`` through ``engine``, at most ``s.concurrency`` in flight (a finished request's
    place goes to the next at once); tokens generated and wall time, prefill included."""
    queue, live, same, tokens = list(enumerate(prompts)), {}, 0, 0
    slowest, stalls = 0.0, 0
    steps_left = 4 * len(prompts) * (max_tokens + 8)  # far above what the requests take
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < s.concurrency:
            i, ids = queue.pop(0)
            request = Request(RequestId(f"{tag}-{i}"), ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                            ignore_eos=s.ignore_eos))
            engine.add_request(request)
            live[request.request_id] = request
        t = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - t
        slowest, stalls = max(slowest, took), stalls + (took > STALL_S)
        for out in outs:
            if out.finish_reason is None or out.request_id not in live:
                continue
            request = live.pop(out.request_id)
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            tokens += len(request.output_ids)
            recorded = book.get(tuple(request.prompt_ids), [])
            same += list(request.output_ids) == recorded[:len(request.output_ids)]
        steps_left -= 1
        if steps_left < 0 or (live and not engine.has_work()):
            for request_id in live:
                engine.abort_request(request_id)
            raise RuntimeError(f"{tag}: {len(live)} requests did not finish")
    return RoundResult(tokens, time.perf_counter() - t0, same, slowest, stalls)


def spec_counts(engine) -> tuple[int, int, int]:
    c = engine.speculative_counters()
    return c.get("spec_draft_tokens", 0), c.get("spec_accepted_tokens", 0), c.get("spec_verifies", 0)


def summarize(rates: list[float], off: list[float]) -> dict[str, Any]:
    """Median tok/s over the rounds and the paired ratios to ``off`` (same rounds): median, range."""
    paired = [x / o for x, o in zip(rates, off)]
    return {"tok_s": round(statistics.median(rates), 1), "rounds_tok_s": [round(x, 1) for x in rates],
            "vs_off": round(statistics.median(paired), 3),
            "vs_off_range": [round(min(paired), 3), round(max(paired), 3)]}


def guarded(arm: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 (reported, the other arms go on)
        traceback.print_exc()
        raise ArmFailed(arm, exc) from exc


def fits(need: float, budget: float) -> bool:
    return budget - elapsed() - RESERVE_S >= need


def run_scenario(engines: dict, s: Scenario, ids: dict[str, list[int]], book: dict, args, step_s: float,
                 share: float) -> dict:
    """One scenario's warm pass and rounds (module docstring); its row of the report. Rounds past
    ``MIN_ROUNDS`` start only if they end within ``share`` seconds from now (its part of the time left)."""
    arms = list(engines)
    share_end = elapsed() + share
    row: dict[str, Any] = {"scenario": s.name, "key": s.key, "concurrency": s.concurrency, "max_tokens": s.max_tokens,
                           "requests_per_round": s.per_round, "ignore_eos": s.ignore_eos}
    first = [ids[p] for p in s.round_prompts(0)]
    warm_tokens = min(args.warm_tokens, s.max_tokens)
    need = warm_tokens * step_s * -(-s.per_round // s.concurrency)  # off's warm pass, at the record's step time
    per_token: dict[str, float] = {}
    for arm in arms:  # untimed: kernels and verify shapes are built here
        if not fits(need, args.time_budget):
            row["skipped"] = (f"time budget ({args.time_budget - elapsed():.0f} s left, {arm}'s warm pass "
                              f"about {need:.0f} s)")
            log(f"{s.name}: skipped ({row['skipped']})")
            return row
        r = guarded(arm, run_round, engines[arm], first, s, warm_tokens, f"{arm}-{s.key}-warm", book)
        per_token[arm] = r.wall / max(r.tokens, 1)
        need = 2.0 + 1.5 * per_token["off"] * r.tokens  # another arm: off's, with room for its new shapes
        log(f"{s.name} warm {arm}: {r.tokens} tokens in {r.wall:.2f} s")
    before = {arm: spec_counts(engines[arm]) for arm in arms}
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    slow: dict[str, list[tuple[float, int]]] = {arm: [] for arm in arms}
    same = {arm: 0 for arm in arms}
    need = 1.2 * sum(per_token.values()) * s.per_round * s.max_tokens
    for r in range(args.rounds):
        budget = args.time_budget if r < MIN_ROUNDS else min(args.time_budget, share_end + RESERVE_S)
        if not fits(need, budget):
            row["rounds_skipped"] = args.rounds - r
            row["skip_reason"] = (f"time budget ({budget - elapsed():.0f} s left for this scenario, a round about "
                                  f"{need:.0f} s)")
            log(f"{s.name}: rounds {r + 1}..{args.rounds} skipped ({row['skip_reason']})")
            break
        prompts = [ids[p] for p in s.round_prompts(r)]
        t0 = time.perf_counter()
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
            res = guarded(arm, run_round, engines[arm], prompts, s, s.max_tokens, f"{arm}-{s.key}-{r}", book)
            rates[arm].append(res.tokens / res.wall)
            slow[arm].append((round(res.slowest_step, 3), res.stalls))
            same[arm] += res.same
            log(f"{s.name} round {r + 1} {arm}: {res.tokens} tokens in {res.wall:.2f} s = {rates[arm][-1]:.1f} tok/s")
        need = 1.1 * (time.perf_counter() - t0)
    row["rounds"] = len(rates["off"])
    if not row["rounds"]:
        row["skipped"] = row.pop("skip_reason")
        return row
    for arm in arms:
        drafted, accepted, verifies = (a - b for a, b in zip(spec_counts(engines[arm]), before[arm]))
        row[arm] = {**summarize(rates[arm], rates["off"]), "draft_tokens": drafted, "accepted_tokens": accepted,
                    "verifies": verifies, "acceptance": round(accepted / drafted, 3) if drafted else None,
                    "rounds_slowest_step_s": [x for x, _ in slow[arm]], "rounds_stalls": [n for _, n in slow[arm]],
                    "same_as_recorded": f"{same[arm]}/{row['rounds'] * s.per_round}"}
    log(f"{s.name}: " + ", ".join(f"{a} {row[a]['tok_s']} tok/s ({row[a]['vs_off']}x, acc {row[a]['acceptance']})"
                                  for a in arms))
    return row


# --- report -----------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    arms = report["arms_run"]
    model = report.get("model", {}).get("name", report["args"]["model"])
    lines = [f"{model}, {report['layout']}, {report['card']}: tok/s (x = median paired ratio to off "
             "[range], acceptance; same = greedy tokens as recorded)", "",
             "| scenario (rounds) | off tok/s | " + " | ".join(f"{a} tok/s (x [range], acceptance)" for a in arms[1:])
             + " | same |", "|---" * (len(arms) + 2) + "|"]
    for row in report["scenarios"]:
        if "off" not in row:
            why = row.get("skipped") or row.get("error", "-")
            lines.append(f"| {row['scenario']} | {why} |" + " |" * len(arms))
            continue
        cells = [f"{row[a]['tok_s']} ({row[a]['vs_off']}x [{row[a]['vs_off_range'][0]}-{row[a]['vs_off_range'][1]}], "
                 f"{row[a]['acceptance']})" if a in row else "-" for a in arms[1:]]
        same = " ".join(f"{a} {row[a]['same_as_recorded']}" for a in arms if a in row)
        lines.append(f"| {row['scenario']} ({row['rounds']}) | {row['off']['tok_s']} | " + " | ".join(cells)
                     + f" | {same} |")
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("bundled", "8b"), required=True)
    p.add_argument("--out", required=True, help="the JSON report; {card} becomes the device's short name")
    p.add_argument("--arms", default=None, help="comma-separated, off first (default: off,ngram,oracle and, "
                                                 "bundled only, draft)")
    p.add_argument("--scenarios", default="long-c1,long-c4,short-c1")
    p.add_argument("--layout", default="kvarn-k4v2", help="the KV layout: kvarn-kXvY, fp16, affine-B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=None, help="long scenarios (default: 384 bundled, 256 8b)")
    p.add_argument("--short-tokens", type=int, default=64)
    p.add_argument("--warm-tokens", type=int, default=64, help="tokens a request in the untimed pass")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds from start")
    p.add_argument("--dtype", default=None, help="bundled: the server's --dtype (auto); 8b: bfloat16")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    args = p.parse_args()
    default_arms = "off,ngram,oracle,draft" if args.model == "bundled" else "off,ngram,oracle"
    args.arms = [a.strip() for a in (args.arms or default_arms).split(",") if a.strip()]
    if args.arms[:1] != ["off"] or not set(args.arms) <= set(ARMS) or len(set(args.arms)) != len(args.arms):
        p.error(f"--arms: off first, then any of {ARMS[1:]}, each once")
    if "draft" in args.arms and args.model != "bundled":
        p.error("--arms: draft is a cut of the bundled model: --model bundled only")
    if args.rounds < 1 or args.short_tokens < 1 or args.warm_tokens < 1 or (args.max_tokens or 1) < 1:
        p.error("--rounds, --max-tokens, --short-tokens and --warm-tokens must be >= 1")
    args.max_tokens = args.max_tokens or (384 if args.model == "bundled" else 256)
    return args


def main() -> int:
    args = parse_args()
    scenarios = make_scenarios(args)
    tmp = Path(tempfile.mkdtemp(prefix="kvarn-spec-"))
    flags = {arm: serve_flags(arm, args.layout, tmp / "draft") for arm in args.arms}
    try:  # bad flags stop here, before any model loads
        for arm, f in flags.items():
            if arm != "draft":
                engine_config(f)
    except (SystemExit, ValueError) as exc:
        raise SystemExit(f"--layout {args.layout!r}: {exc}") from None
    card = card_name()
    out = Path(args.out.replace("{card}", card))
    out.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    log("environment", json.dumps(env))
    report: dict[str, Any] = {"env": env, "card": card, "openblas": openblas_active(), "args": vars(args),
                              "layout": args.layout, "ngram_flags": list(NGRAM_FLAGS), "oracle_k": ORACLE_K,
                              "arms": {}, "arms_run": [], "scenarios": []}

    def save() -> None:
        report["elapsed_s"] = round(elapsed(), 1)
        out.write_text(json.dumps(report, indent=1) + "\n")

    engines: dict[str, Any] = {}
    try:
        run(args, scenarios, flags, tmp, report, engines, save)
    except Exception as exc:  # noqa: BLE001 (the report says what failed; the table shows what ran)
        traceback.print_exc()
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report["markdown"] = markdown(report)
    save()
    log(f"done: {out}")
    print(report["markdown"], flush=True)
    return 0 if "error" not in report and report["scenarios"] else 1


def run(args, scenarios: list[Scenario], flags: dict, tmp: Path, report: dict, engines: dict, save) -> None:
    loaded = load(args)
    weights = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    report["model"] = {"name": loaded.model_id, "dtype": loaded.compute_dtype, "weights_bytes": weights}
    log(f"model {loaded.model_id}: {weights / 1e9:.2f} GB of {loaded.compute_dtype} weights")
    texts = {p for s in scenarios for r in range(args.rounds) for p in s.round_prompts(r)}
    ids = {p: chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": p}]) for p in texts}
    engines["off"], report["arms"]["off"] = make_arm(loaded, "off", flags["off"], None)
    log(f"off: {report['arms']['off']}")
    lengths = {p: max(s.max_tokens for s in scenarios if p in s.prompts) for p in texts}
    t0 = time.perf_counter()
    entries = greedy_book(engines["off"], loaded.tokenizer, lengths, id_prefix="book-")
    wall = time.perf_counter() - t0
    step_s = wall / max(lengths.values())  # one step of every prompt at once: a pessimistic step time
    report["record"] = {"prompts": len(entries), "tokens": sum(len(e["output"]) for e in entries),
                        "wall_s": round(wall, 2)}
    log(f"recorded {len(entries)} greedy continuations in {wall:.1f} s")
    book = {tuple(e["prompt"]): e["output"] for e in entries}
    if "draft" in flags:
        from engine.draft_model import write_layer_subset

        write_layer_subset(BUNDLED_MODEL_DIR, tmp / "draft", DRAFT_LAYERS)
        report["draft_model"] = f"{loaded.model_id}, layers {list(DRAFT_LAYERS)}"
    for arm in args.arms[1:]:
        try:
            engines[arm], report["arms"][arm] = make_arm(loaded, arm, flags[arm], entries)
            log(f"{arm}: {report['arms'][arm]}")
        except Exception as exc:  # noqa: BLE001 (the other arms go on)
            traceback.print_exc()
            report["arms"][arm] = {"flags": flags[arm][1:], "error": f"{type(exc).__name__}: {exc}"}
    report["arms_run"] = list(engines)
    save()
    for i, s in enumerate(scenarios):
        left = args.time_budget - elapsed() - RESERVE_S
        log(f"scenario {s.name} ({left:.0f} s left)")
        try:
            row = run_scenario(engines, s, ids, book, args, step_s, left / (len(scenarios) - i))
        except ArmFailed as exc:
            row = {"scenario": s.name, "key": s.key, "error": str(exc)}
            if exc.arm == "off":
                report["scenarios"].append(row)
                raise
            engines.pop(exc.arm).close()
            report["arms"][exc.arm]["error"] = str(exc)
        report["scenarios"].append(row)
        save()
        mx.clear_cache()


if __name__ == "__main__":
    sys.exit(main())
