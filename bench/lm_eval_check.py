"""lm-eval through ``kvarn serve``: every log-likelihood checked against mlx-lm in process.

For each arm (``--arms``, default ``fp16,kvarn``: ``kvarn serve --kv-scheme fp16`` and the default
``kvarn serve``, KVarN k4v2), a server is started on a free loopback port (bounded start-up, always
stopped), and lm-eval's own ``local-completions`` model class (``lm_eval.simple_evaluate``,
``log_samples=True``, batch size 2, token-id prompts from the model folder's Hugging Face tokenizer)
runs the three local tasks of ``bench/lm_eval_task``:

- ``kvarn_mc``: multiple choice (``loglikelihood``: ``echo`` + ``logprobs`` + ``max_tokens: 1`` on
  ``/v1/completions``, two prompts a request);
- ``kvarn_text``: ``loglikelihood_rolling`` (perplexity of short texts);
- ``kvarn_gen``: ``generate_until`` (greedy, until a newline).

The reference is mlx-lm's own forward on the bundled model, loaded in this process with
``mlx_lm.load`` and cast as the server casts it (``engine.loader``: dequantized to float32 on MLX's
CPU backend): the log-softmax of the full token sequence, one forward per sequence. Checked:

- every HTTP answer lm-eval got: one choice per prompt in ``index`` order, ``len(prompt) + 1``
  tokens (the prompt echoed, then the one generated token), the first logprob ``null``, and every
  other prompt token's logprob against the reference (``token`` rows);
- every lm-eval sample: its log-likelihood (a sum over the continuation, or over a text's rolling
  windows) and ``is_greedy`` recomputed from the same token ids (``sample`` rows);
- ``generate_until``: the server's text against mlx-lm greedy decoding from the same ids (a
  difference is accepted only at a near tie: a reference top-2 gap under 1e-3 nats).

The fp16 arm must agree to ``--tol`` (1e-4) everywhere; KVarN's differences are reported (max / mean
absolute difference, the accuracy lm-eval computes, the multiple-choice answers that differ from the
reference's). Exit status 1 when an fp16 check or any structural check fails.

    python bench/lm_eval_check.py [--arms fp16,kvarn] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvarn_server import served  # bench/ is on sys.path when this runs as a script

REPO = Path(__file__).resolve().parents[1]
TASK_DIR = REPO / "bench" / "lm_eval_task"
MODEL_DIR = REPO / "engine" / "bundled" / "fixture-chat-29m-q8"
MODEL_ID = MODEL_DIR.name
TASKS = ["kvarn_mc", "kvarn_text", "kvarn_gen"]
ARMS = {"fp16": ["--kv-scheme", "fp16"], "kvarn": []}
MAX_LENGTH = 4096  # the bundled model's context
STARTUP_TIMEOUT_S = 120.0
NEAR_TIE = 1e-3


# --- the reference: mlx-lm in process ---------------------------------------------------------------

class Reference:
    """mlx-lm's forward on the bundled model, cast as ``engine.loader`` casts it for the server."""

    def __init__(self) -> None:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.utils import dequantize_model

        from engine.loader import resolve_dtype

        self.mx = mx
        model, tokenizer = load(str(MODEL_DIR))
        self.dtype = resolve_dtype("auto")
        if self.dtype is not None:
            model = dequantize_model(model)
            model.set_dtype(getattr(mx, self.dtype))
        mx.eval(model.parameters())
        self.model, self.tokenizer = model, tokenizer
        self.eos = set(tokenizer.eos_token_ids)
        self._cache: dict[tuple[int, ...], Any] = {}

    def logprobs(self, ids: list[int]):
        """[len(ids), vocab] float32 numpy: row t is log p(next | ids[:t+1])."""
        import numpy as np

        key = tuple(ids)
        if key not in self._cache:
            mx = self.mx
            logits = self.model(mx.array(ids)[None])[0].astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            self._cache[key] = np.array(logp)
        return self._cache[key]

    def score(self, ids: list[int], start: int) -> tuple[float, bool]:
        """Sum of log p(ids[t] | ids[:t]) for t >= start, and whether every one is the argmax."""
        logp = self.logprobs(ids)
        total, greedy = 0.0, True
        for t in range(start, len(ids)):
            total += float(logp[t - 1, ids[t]])
            greedy &= int(logp[t - 1].argmax()) == ids[t]
        return total, greedy

    def greedy(self, ids: list[int], max_tokens: int, stops: list[str]) -> tuple[str, list[int], list[float]]:
        """Greedy text from ``ids`` (full forward each step) cut at the first stop string, its
        tokens, and the top-2 gap of every step."""
        import numpy as np

        out: list[int] = []
        gaps: list[float] = []
        for _ in range(max_tokens):
            row = self.logprobs(ids + out)[-1]
            top2 = np.partition(row, -2)[-2:]
            gaps.append(float(abs(top2[1] - top2[0])))
            tok = int(row.argmax())
            if tok in self.eos:
                break
            out.append(tok)
            text = self.tokenizer.decode(out)
            if any(s in text for s in stops):
                break
        text = self.tokenizer.decode(out)
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
        return text, out, gaps


# --- one arm ---------------------------------------------------------------------------------------

def run_lm_eval(base: str) -> tuple[dict, Any, list[tuple[bool, list, dict, dict]]]:
    """lm-eval's local-completions against ``base``; returns (results, the LM, every HTTP call)."""
    import copy

    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(model=MODEL_ID, base_url=f"{base}/v1/completions", tokenizer_backend="huggingface",
                             tokenizer=str(MODEL_DIR), tokenized_requests=True, batch_size=2,
                             max_length=MAX_LENGTH, max_retries=1, timeout=120)
    calls: list[tuple[bool, list, dict, dict]] = []
    model_call = lm.model_call

    def recording(messages, *, generate=True, gen_kwargs=None, **kwargs):
        out = model_call(messages, generate=generate, gen_kwargs=copy.deepcopy(gen_kwargs), **kwargs)
        calls.append((generate, messages, copy.deepcopy(gen_kwargs) or {}, out))
        return out

    lm.model_call = recording
    results = simple_evaluate(model=lm, tasks=TASKS, task_manager=TaskManager(include_path=str(TASK_DIR)),
                              log_samples=True, bootstrap_iters=1000, random_seed=0)
    return results, lm, calls


def _diffs(values: list[float]) -> dict:
    return {"n": len(values), "max_abs": max(values, default=0.0),
            "mean_abs": sum(values) / len(values) if values else 0.0}


def _arguments(doc: dict) -> list[tuple]:
    """A sample's requests' arguments (in memory a list of tuples; in lm-eval's logs a dict
    ``gen_args_k: {arg_0: ..}``)."""
    args = doc["arguments"]
    if isinstance(args, dict):
        args = [tuple(a[f"arg_{i}"] for i in range(len(a)))
                for _, a in sorted(args.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1]))]
    return [tuple(a) for a in args]


def _ll(resp) -> tuple[float, bool]:
    """A sample's response: lm-eval keeps [(ll, is_greedy)] or [ll], its logs keep strings."""
    while isinstance(resp, (list, tuple)) and len(resp) == 1:
        resp = resp[0]
    if isinstance(resp, (list, tuple)):
        return float(resp[0]), str(resp[1]) == "True"
    return float(resp), True


def check_arm(name: str, results: dict, lm: Any, calls: list, ref: Reference) -> dict:
    """Every call and every sample of one arm against the reference."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    problems: list[str] = []
    token_diffs: list[float] = []
    for generate, messages, _, out in calls:
        if generate:
            continue
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if [c["index"] for c in choices] != list(range(len(messages))):
            problems.append(f"choice indices {[c['index'] for c in out['choices']]} for {len(messages)} prompts")
            continue
        for ids, choice in zip(messages, choices):
            lp = choice["logprobs"]
            if len(lp["token_logprobs"]) != len(ids) + 1 or lp["token_logprobs"][0] is not None:
                problems.append(f"{len(ids)}-token prompt: {len(lp['token_logprobs'])} logprobs, first "
                                f"{lp['token_logprobs'][0]!r} (want {len(ids) + 1}, first null)")
                continue
            if lp["top_logprobs"][0] is not None or len(lp["top_logprobs"]) != len(ids) + 1:
                problems.append(f"{len(ids)}-token prompt: top_logprobs malformed")
            logp = ref.logprobs(ids)
            for t in range(1, len(ids)):
                token_diffs.append(abs(lp["token_logprobs"][t] - float(logp[t - 1, ids[t]])))

    sample_diffs: list[float] = []
    greedy_mismatch = 0
    mc = {"n": 0, "server_correct": 0, "ref_correct": 0, "answer_differs": 0}
    rolling_diffs: list[float] = []
    gen = {"n": 0, "same_text": 0, "near_tie": 0, "differs": []}
    samples = results["samples"]
    for doc in samples["kvarn_mc"]:
        scores, refs = [], []
        for (context, continuation), resp in zip(_arguments(doc), doc["resps"]):
            ctx, cont = lm._encode_pair(context, continuation)
            ll, greedy = _ll(resp)
            r_ll, r_greedy = ref.score(ctx + cont, len(ctx))
            sample_diffs.append(abs(ll - r_ll))
            greedy_mismatch += greedy != r_greedy
            scores.append(ll)
            refs.append(r_ll)
        target = int(doc["target"])
        mc["n"] += 1
        mc["server_correct"] += scores.index(max(scores)) == target
        mc["ref_correct"] += refs.index(max(refs)) == target
        mc["answer_differs"] += scores.index(max(scores)) != refs.index(max(refs))
    for doc in samples["kvarn_text"]:
        (text,) = _arguments(doc)[0]
        r_ll = 0.0
        for ctx, pred in map(make_disjoint_window,
                             get_rolling_token_windows(token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id,
                                                       max_seq_len=lm.max_length - 1, context_len=1)):
            r_ll += ref.score(ctx + pred, len(ctx))[0]
        ll = _ll(doc["resps"][0])[0]
        rolling_diffs.append(abs(ll - r_ll))
    for generate, messages, gen_kwargs, out in calls:
        if not generate:
            continue
        stops = [*gen_kwargs.get("until", []), lm.eos_string]
        max_tokens = gen_kwargs.get("max_gen_toks", 256)
        for ids, choice in zip(messages, sorted(out["choices"], key=lambda c: c["index"])):
            gen["n"] += 1
            text, out_ids, gaps = ref.greedy(list(ids), max_tokens, stops)
            if choice["text"] == text:
                gen["same_text"] += 1
                continue
            # the first reference step whose text leaves the server's: a near tie there is rounding
            step = next((k for k in range(len(out_ids))
                         if not choice["text"].startswith(ref.tokenizer.decode(out_ids[: k + 1]))),
                        len(gaps) - 1)
            tie = gaps[step] < NEAR_TIE
            gen["near_tie"] += tie
            gen["differs"].append({"prompt": ref.tokenizer.decode(list(ids))[-60:], "server": choice["text"],
                                   "reference": text, "step": step, "top2_gap": gaps[step]})
    metrics = {task: {k.split(",")[0]: v for k, v in res.items() if not k.split(",")[0].endswith("_stderr")
                      and k != "alias"} for task, res in results["results"].items()}
    return {"arm": name, "metrics": metrics, "token": _diffs(token_diffs),
            "sample": _diffs(sample_diffs + rolling_diffs), "mc_sample": _diffs(sample_diffs), "rolling_sample": _diffs(rolling_diffs),
            "is_greedy_mismatch": greedy_mismatch, "mc": mc, "gen": gen, "problems": problems,
            "requests": {"loglikelihood": sum(not g for g, *_ in calls), "generate": sum(g for g, *_ in calls)}}


def verdict(report: dict, tol: float) -> list[str]:
    """What fails: structure in every arm; agreement to ``tol`` (and generation) in the fp16 arm."""
    failures = [f"{report['arm']}: {p}" for p in report["problems"]]
    if report["arm"] == "fp16":
        for key in ("token", "sample"):
            if report[key]["max_abs"] > tol:
                failures.append(f"fp16: {key} logprob max abs diff {report[key]['max_abs']:.3g} > {tol:g}")
        if report["is_greedy_mismatch"]:
            failures.append(f"fp16: is_greedy differs from the reference in {report['is_greedy_mismatch']} samples")
        if report["mc"]["answer_differs"]:
            failures.append(f"fp16: {report['mc']['answer_differs']} multiple-choice answers differ from the reference")
        bad = report["gen"]["n"] - report["gen"]["same_text"] - report["gen"]["near_tie"]
        if bad:
            failures.append(f"fp16: {bad} generations differ from mlx-lm greedy away from a near tie")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default="fp16,kvarn", help="comma-separated: fp16, kvarn (default: both)")
    parser.add_argument("--tol", type=float, default=1e-4, help="fp16 agreement bound, nats (default 1e-4)")
    parser.add_argument("--json", type=Path, help="write the report here as JSON")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    for arm in arms:
        if arm not in ARMS:
            parser.error(f"unknown arm {arm!r} (choose from {', '.join(ARMS)})")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    started = time.monotonic()
    ref = Reference()
    reports, failures = [], []
    with tempfile.TemporaryDirectory(prefix="kvarn-lm-eval-") as tmp:
        for arm in arms:
            t0 = time.monotonic()
            with served(ARMS[arm], Path(tmp) / f"{arm}.log", STARTUP_TIMEOUT_S) as server:
                base = server.base
                t_up = time.monotonic() - t0
                results, lm, calls = run_lm_eval(base)
            t_eval = time.monotonic() - t0 - t_up
            t1 = time.monotonic()
            report = check_arm(arm, results, lm, calls, ref)
            report["seconds"] = {"server_start": round(t_up, 1), "lm_eval": round(t_eval, 1),
                                 "reference_check": round(time.monotonic() - t1, 1)}
            reports.append(report)
            failures += verdict(report, args.tol)
    summary = {"reference_dtype": ref.dtype or "native", "tol": args.tol, "arms": reports,
               "seconds": round(time.monotonic() - started, 1), "failures": failures}
    for r in reports:
        m = r["metrics"]
        print(f"[{r['arm']}] {r['requests']['loglikelihood']} loglikelihood + {r['requests']['generate']} "
              f"generate requests; per-token |diff| max {r['token']['max_abs']:.3g} mean {r['token']['mean_abs']:.3g} (n={r['token']['n']}); "
              f"per-sample max {r['sample']['max_abs']:.3g} mean {r['sample']['mean_abs']:.3g} (n={r['sample']['n']})")
        print(f"[{r['arm']}] mc acc {m['kvarn_mc']['acc']:.4f} acc_norm {m['kvarn_mc']['acc_norm']:.4f} "
              f"(reference acc {r['mc']['ref_correct'] / max(r['mc']['n'], 1):.4f}, "
              f"answers differing {r['mc']['answer_differs']}); "
              f"text word_ppl {m['kvarn_text']['word_perplexity']:.4f} bits/byte {m['kvarn_text']['bits_per_byte']:.6f}; "
              f"gen exact_match {m['kvarn_gen']['exact_match']:.4f}, same text as mlx-lm greedy "
              f"{r['gen']['same_text']}/{r['gen']['n']} (near ties {r['gen']['near_tie']}); {r['seconds']}")
    print(f"total {summary['seconds']} s; " + ("PASS" if not failures else "FAIL:\n  " + "\n  ".join(failures)))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from server.blas import maybe_reexec_with_openblas  # before MLX: the server runs under OpenBLAS too

    maybe_reexec_with_openblas()
    sys.exit(main())
