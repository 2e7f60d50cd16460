"""Greedy tokens of the bundled model through the engine, per arm, and their comparison between two
revisions: a change to the KV storage must leave every arm's tokens identical.

The bundled model (``engine/bundled/fixture-chat-29m-q8``, compute dtype ``auto``: float32 on
CPU) runs 8 fixed chat prompts (``PROMPTS``: through the chat template, 50 to 600 tokens, four
longer than 256 so KVarN commits tiles and the prefix cache has whole 128-token blocks to hit),
greedy, 256 tokens each with EOS ignored. For every layout (``fp16``, ``k4v2`` = KVarN 4-bit keys,
2-bit values; also ``kXvY``, ``affineB``) four arms, each a fresh engine:

* ``LAYOUT/no-apc/c1``: prefix cache off, the prompts one at a time;
* ``LAYOUT/no-apc/batch8``: prefix cache off, all prompts added at once (continuous batching:
  chunked prefills beside decoding rows, then one batched decode; ``batchN`` for ``--prompts N``);
* ``LAYOUT/apc-cold``: prefix cache on, each prompt's first run (nothing of it cached);
* ``LAYOUT/apc-hit``: the same prompt again right after, restored from the cache. Its cached
  prompt tokens are recorded and must be > 0 for every prompt longer than 256 tokens, else
  the arm proves nothing and ``record`` fails.

Commands (the process preloads OpenBLAS as the ``kvarn`` command does, ``server/blas.py``;
``PYTHONPATH`` picks the checkout whose ``engine`` runs, by default this script's own)::

    python bench/greedy_parity.py record --out FILE.json [--layouts fp16,k4v2] [--prompts 8] [--tokens 256]
    python bench/greedy_parity.py compare BEFORE.json AFTER.json [--md OUT.md]
    python bench/greedy_parity.py --base REV --out bench/results/greedy-parity.json

``record`` writes ``{meta: {revision, dirty, tree, layouts, prompt_tokens, prompts_sha256,
cached_tokens, seconds, wall_seconds, ...}, arms: {name: [token list per prompt]}}``. ``compare``
says per arm whether the tokens are identical and, where not, each differing prompt and its first
differing position; it exits 1 on any difference (a missing arm or different prompt ids
included). Its markdown also counts, per arm and revision, the prompts whose tokens equal the same
layout's ``no-apc/c1`` tokens: a note on what batching and restoring do within a revision, not
part of the verdict.
``--base REV`` records REV in a temporary ``git worktree`` (a subprocess, ``PYTHONPATH`` and cwd
the worktree, this script file), then this checkout, compares them and writes one result JSON
(both revisions' meta, per-arm identical flags, first differences) and a markdown table beside
it (``OUT.md``); it exits 1 on any difference. Exit 2: an error (a bad file or layout, a failed
record). Only names ``engine`` exported at ``e5a6a71`` are used (and ``server.blas``), so the
script runs unchanged against that revision. About 7 minutes a revision on 2 CPU cores at the
defaults (``--base``: twice that).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LONG_PROMPT_TOKENS = 256  # a prompt longer than this holds whole 128-token blocks: apc-hit must restore some

# this folder holds modules named like the repo's packages (bench/apc.py): never import from it
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(REPO))

_P1 = ("The river town kept its old stone bridge long after the railway came. Every spring the market "
       "filled the square beside it with bread, cheese, honey and cuttings of apple trees, and farmers from "
       "the hills walked down before dawn to claim the places closest to the water. The mayor once proposed "
       "moving the market to a new hall near the station, but the traders refused, saying that people came "
       "for the river as much as for the goods.")
_P2 = ("A lighthouse keeper's logbook from the last century records the weather four times a day: wind "
       "direction, sea state, visibility and the number of ships that passed. On calm nights the entries are "
       "short, a single line in careful handwriting. During storms they grow long and hurried, describing "
       "waves that broke over the lantern gallery and a lamp that had to be trimmed every hour so that its "
       "beam would not fail.")
_P3 = ("To sort a list of records by several keys, sort first by the least important key and then by the "
       "more important ones, relying on the sort being stable. Python's built-in sort is stable, so records "
       "that compare equal on the current key keep the order that the previous pass gave them. For large "
       "lists it is usually faster to sort once with a tuple key, which compares the keys in order.")
_P4 = ("The committee met on Tuesday to review the budget for the new library. The architect presented "
       "three designs: a compact building of two floors, a wider single floor with a courtyard, and a tower "
       "that would leave room for a park. Members worried about heating costs in winter, about access for "
       "people in wheelchairs, and about whether the reading rooms would be quiet enough near the main road.")
_P5 = ("Bread dough rises because yeast turns sugars into carbon dioxide, which the gluten network traps "
       "in small bubbles. A cool, slow rise gives the yeast and bacteria time to develop flavour, while a warm "
       "kitchen makes the dough ready in an hour but leaves it plainer. Bakers judge the dough by feel: it "
       "should spring back slowly when pressed with a floured finger.")
_P6 = ("In the small observatory on the hill, students take turns at the telescope on clear evenings. They "
       "begin with the moon, then look for Jupiter and its four bright moons, and late at night they try to "
       "find faint galaxies. The teacher asks each student to draw what they see instead of taking "
       "photographs, because drawing forces the eye to notice detail.")


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


PROMPTS: tuple[list[dict[str, str]], ...] = (
    _user("What is the difference between a list and a tuple in Python, and when would you choose each of "
          "them? Answer in two short sentences."),
    [{"role": "system", "content": "You are a careful travel guide who answers in plain, friendly English and "
                                   "always mentions one practical tip."},
     {"role": "user", "content": "I have one free afternoon in a small river town in spring. What should I do "
                                 "there, and what should I bring with me?"}],
    _user("Read this passage and say in one sentence why the traders refused to move.\n\n" + _P1),
    [{"role": "user", "content": "Explain how to sort records by several keys in Python."},
     {"role": "assistant", "content": _P3},
     {"role": "user", "content": "Show a short example that sorts people by age and then by name, and say "
                                 "which of the two approaches you would choose and why."}],
    _user("Here are two notes from an old archive. Compare their tone and list three differences.\n\n"
          + _P2 + "\n\n" + _P4),
    _user("Summarise each of the following paragraphs in one line, then give them a common title.\n\n"
          + "\n\n".join((_P5, _P6, _P1))),
    [{"role": "system", "content": "You are a patient tutor. Keep every answer under one hundred words."},
     {"role": "user", "content": "I am studying for an exam on everyday science. Here is my first text.\n\n" + _P5},
     {"role": "assistant", "content": "Thank you. The text explains that yeast makes gas that gluten traps, and "
                                      "that a slow rise gives more flavour. What would you like to practise?"},
     {"role": "user", "content": "Now read these two as well and write three exam questions that connect all "
                                 "three texts.\n\n" + _P6 + "\n\n" + _P2}],
    _user("You are given the minutes and background notes of a town meeting. Write a short report for the "
          "local newspaper that a reader can follow without the notes.\n\n"
          + "\n\n".join((_P4, _P1, _P3, _P2, _P6))),
)


def fail(message: str) -> NoReturn:
    """A usage or input error, or an arm that would prove nothing: exit 2 (1 means "tokens differ")."""
    sys.stderr.write(f"greedy_parity: {message}\n")
    raise SystemExit(2)


# --- compare (no MLX: plain JSON) ---

def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a shorter list differs where it ends), or None."""
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if k == len(a) == len(b) else k


def compare_records(base: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """Per arm of either record: identical or not, and each differing prompt's first differing
    position with both tokens there (None past a list's end). Arms missing on one side and
    different prompt ids are problems; ``identical`` is True only when there are none."""
    arms: dict[str, Any] = {}
    problems: list[str] = []
    if base["meta"].get("prompts_sha256") != current["meta"].get("prompts_sha256"):
        problems.append("the prompts' token ids differ (tokenizer or chat template): not like for like")
    for name in list(base["arms"]) + [n for n in current["arms"] if n not in base["arms"]]:
        if name not in base["arms"] or name not in current["arms"]:
            problems.append(f"arm {name} only in the {'current' if name not in base['arms'] else 'base'} record")
            continue
        rows_a, rows_b = base["arms"][name], current["arms"][name]
        diffs = []
        for i in range(max(len(rows_a), len(rows_b))):
            a, b = (rows_a[i] if i < len(rows_a) else []), (rows_b[i] if i < len(rows_b) else [])
            k = first_difference(a, b)
            if k is not None:
                diffs.append({"prompt": i, "position": k, "base": a[k] if k < len(a) else None,
                              "current": b[k] if k < len(b) else None})
        arms[name] = {"identical": not diffs, "prompts": len(rows_a), "differences": diffs}
    return {"identical": not problems and all(a["identical"] for a in arms.values()),
            "problems": problems, "arms": arms}


def describe(result: dict[str, Any]) -> list[str]:
    """One line per arm and per problem."""
    lines = [f"problem: {p}" for p in result["problems"]]
    for name, arm in result["arms"].items():
        if arm["identical"]:
            lines.append(f"{name}: identical ({arm['prompts']} prompts)")
        else:
            where = "; ".join(f"prompt {d['prompt']} at token {d['position']} ({d['base']} vs {d['current']})"
                              for d in arm["differences"])
            lines.append(f"{name}: DIFFERS in {len(arm['differences'])} of {arm['prompts']} prompts: {where}")
    return lines


def same_as_solo(record: dict[str, Any], name: str) -> int | None:
    """How many prompts of arm ``name`` have the tokens of its layout's ``no-apc/c1`` arm."""
    solo = record["arms"].get(name.split("/")[0] + "/no-apc/c1")
    rows = record["arms"].get(name)
    return None if solo is None or rows is None else sum(a == b for a, b in zip(rows, solo))


def _revision(meta: dict[str, Any]) -> str:
    return f"{meta.get('revision', '?')[:12]}{' (uncommitted changes)' if meta.get('dirty') else ''}"


def markdown(result: dict[str, Any], base: dict[str, Any], current: dict[str, Any]) -> str:
    m = base["meta"]
    head = [f"Greedy tokens, base {_revision(m)} vs current {_revision(current['meta'])}: "
            f"{'**identical**' if result['identical'] else '**DIFFERENT**'}", "",
            f"Model `{m.get('model')}` ({m.get('compute_dtype')}), {len(m.get('prompt_tokens', []))} chat prompts "
            f"of {m.get('prompt_tokens')} tokens, {m.get('tokens')} greedy tokens each (EOS ignored); "
            "apc-hit cached prompt tokens (base / current): "
            + ", ".join(f"{k}: {m.get('cached_tokens', {}).get(k)} / {current['meta'].get('cached_tokens', {}).get(k)}"
                        for k in m.get("cached_tokens", {}) if k.endswith("apc-hit")), ""]
    head += [f"- problem: {p}" for p in result["problems"]]
    rows = ["| arm | identical | first differences (prompt: position) | prompts as no-apc/c1 (base / current) |",
            "|---|---|---|---|"]
    for name, arm in result["arms"].items():
        diffs = ", ".join(f"{d['prompt']}: {d['position']}" for d in arm["differences"]) or "-"
        solo = " / ".join(str(same_as_solo(r, name)) for r in (base, current))
        rows.append(f"| {name} | {'yes' if arm['identical'] else 'NO'} | {diffs} | {solo} |")
    return "\n".join(head + ([""] if result["problems"] else []) + rows) + "\n"


def _load(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        fail(f"cannot read {path}: {exc}")
    if not isinstance(record, dict) or not isinstance(record.get("arms"), dict) or "meta" not in record:
        fail(f"{path} is not a record (no meta and arms)")
    return record


def cmd_compare(args: argparse.Namespace) -> int:
    base, current = _load(args.base_file), _load(args.current_file)
    result = compare_records(base, current)
    print("\n".join(describe(result)))
    if args.md:
        Path(args.md).write_text(markdown(result, base, current))
    return 0 if result["identical"] else 1


# --- record (imports the engine of the checkout on PYTHONPATH) ---

def parse_layout(name: str) -> Any:
    """``fp16``, ``kXvY`` (KVarN X-bit keys, Y-bit values) or ``affineB`` as an ``engine.KVConfig``."""
    from engine import KVConfig

    if name == "fp16":
        return KVConfig("fp16")
    if name.startswith("affine") and name[6:].isdigit():
        return KVConfig("affine", int(name[6:]), int(name[6:]))
    key, _, value = name[1:].partition("v")
    if name.startswith("k") and key.isdigit() and value.isdigit():
        return KVConfig("kvarn", int(key), int(value))
    fail(f"bad layout {name!r}: use fp16, kXvY (KVarN) or affineB")


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout.strip()


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 gives a BatchEncoding


def generate(engine: Any, prompts: list[list[int]], tokens: int, tag: str) -> list[tuple[list[int], int]]:
    """Add every prompt at once, step until all finished; (greedy tokens, cached prompt tokens) each."""
    from engine import Request, RequestId, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    requests = [Request(RequestId(f"{tag}-{i}"), list(p), params) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
    for request in requests:
        if len(request.output_ids) != tokens or getattr(request.finish_reason, "value", None) != "length":
            raise RuntimeError(f"{request.request_id}: {len(request.output_ids)} of {tokens} tokens, "
                               f"finished {request.finish_reason}")
    return [(list(r.output_ids), r.num_cached_tokens) for r in requests]


def record_layout(loaded: Any, layout: str, prompts: list[list[int]], tokens: int,
                  meta: dict[str, Any]) -> dict[str, list[list[int]]]:
    """The four arms of one layout, each on a fresh engine; cached tokens and seconds go to ``meta``."""
    from engine import ApcConfig, SchedulerConfig, make_engine

    arms: dict[str, list[tuple[list[int], int]]] = {}
    for apc, name, run in (
        (False, "no-apc/c1", lambda e: [generate(e, [p], tokens, f"c1-{i}")[0] for i, p in enumerate(prompts)]),
        (False, f"no-apc/batch{len(prompts)}", lambda e: generate(e, prompts, tokens, "batch")),
        (True, "apc", lambda e: [row for i, p in enumerate(prompts)
                                 for row in (generate(e, [p], tokens, f"cold-{i}")[0],
                                             generate(e, [p], tokens, f"hit-{i}")[0])]),
    ):
        engine = make_engine(loaded, SchedulerConfig(), parse_layout(layout), ApcConfig(enabled=apc))
        meta["kv"][layout] = engine.describe_kv()
        start = time.perf_counter()
        rows = run(engine)
        engine.close()
        if apc:
            arms[f"{layout}/apc-cold"], arms[f"{layout}/apc-hit"] = rows[0::2], rows[1::2]
        else:
            arms[f"{layout}/{name}"] = rows
        meta["seconds"][f"{layout}/{name}"] = round(time.perf_counter() - start, 2)
        logging.info("%s/%s: %.1f s", layout, name, time.perf_counter() - start)
    for name, rows in arms.items():
        meta["cached_tokens"][name] = [cached for _, cached in rows]
    missed = [i for i, (p, (_, cached)) in enumerate(zip(prompts, arms[f"{layout}/apc-hit"]))
              if len(p) > LONG_PROMPT_TOKENS and cached == 0]
    if missed:
        fail(f"{layout}/apc-hit restored nothing for prompts {missed} "
             f"(longer than {LONG_PROMPT_TOKENS} tokens): the arm would prove nothing")
    return {name: [ids for ids, _ in rows] for name, rows in arms.items()}


def cmd_record(args: argparse.Namespace) -> int:
    from server.blas import maybe_reexec_with_openblas, openblas_active

    maybe_reexec_with_openblas()  # before MLX is imported, as the kvarn command does
    import mlx.core as mx

    import engine as engine_package
    from engine import load_model

    started = time.perf_counter()
    tree = Path(engine_package.__file__).resolve().parents[1]
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    for layout in layouts:
        parse_layout(layout)  # a bad name fails before any arm runs
    loaded = load_model(None, args.dtype)
    prompts = [chat_ids(loaded.tokenizer, m) for m in PROMPTS[: args.prompts]]
    if not any(len(p) > LONG_PROMPT_TOKENS for p in prompts):
        fail(f"no prompt longer than {LONG_PROMPT_TOKENS} tokens: the prefix cache "
             "arms would prove nothing (use more prompts)")
    meta: dict[str, Any] = {
        "revision": _git(tree, "rev-parse", "HEAD"), "dirty": bool(_git(tree, "status", "--porcelain")),
        "changes": _git(tree, "status", "--porcelain").splitlines()[:50], "tree": str(tree),
        "model": loaded.model_id, "fingerprint": loaded.fingerprint, "compute_dtype": loaded.compute_dtype,
        "device": str(mx.default_device()), "mlx": mx.__version__, "openblas": openblas_active(),
        "layouts": layouts, "tokens": args.tokens, "prompt_tokens": [len(p) for p in prompts],
        "prompts_sha256": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "kv": {}, "cached_tokens": {}, "seconds": {},
    }
    arms: dict[str, list[list[int]]] = {}
    for layout in layouts:
        arms.update(record_layout(loaded, layout, prompts, args.tokens, meta))
    meta["wall_seconds"] = round(time.perf_counter() - started, 1)
    Path(args.out).write_text(json.dumps({"meta": meta, "arms": arms}) + "\n")
    logging.info("recorded %d arms of %s in %.0f s: %s", len(arms), meta["revision"][:12], meta["wall_seconds"],
                 args.out)
    return 0


# --- --base REV: both revisions in subprocesses, then compare ---

def record_tree(tree: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``record`` run on ``tree`` (cwd and ``PYTHONPATH`` the tree, this script file)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("KVARN_OPENBLAS_REEXEC", None)  # the child preloads OpenBLAS itself
    command = [sys.executable, str(Path(__file__).resolve()), "record", "--out", str(out), "--layouts",
               args.layouts, "--prompts", str(args.prompts), "--tokens", str(args.tokens), "--dtype", args.dtype]
    subprocess.run(command, cwd=tree, env=env, check=True)
    record = _load(out)
    if Path(record["meta"]["tree"]) != tree.resolve():
        fail(f"the engine of {record['meta']['tree']} ran, not {tree}'s")
    return record


def cmd_base(args: argparse.Namespace) -> int:
    if not args.out:
        fail("--base needs --out FILE.json")
    with tempfile.TemporaryDirectory(prefix="greedy-parity-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.base], check=True)
        try:
            base = record_tree(tree, Path(tmp) / "base.json", args)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)
        current = record_tree(REPO, Path(tmp) / "current.json", args)
    result = compare_records(base, current)
    out = Path(args.out)
    out.write_text(json.dumps({"base": base["meta"], "current": current["meta"], **result}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result, base, current))
    print("\n".join(describe(result)))
    return 0 if result["identical"] else 1


def _add_record_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", default="fp16,k4v2", help="comma-separated: fp16, kXvY (KVarN), affineB")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1),
                   metavar=f"1..{len(PROMPTS)}")
    p.add_argument("--tokens", type=int, default=256, help="greedy tokens a prompt (EOS ignored)")
    p.add_argument("--dtype", default="auto", help="compute dtype (the kvarn command's --dtype)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", metavar="REV", help="record REV (a temporary worktree) and this checkout; compare")
    parser.add_argument("--out", help="--base: the result JSON (a .md table is written beside it)")
    _add_record_args(parser)
    sub = parser.add_subparsers(dest="command")
    record = sub.add_parser("record", help="record every arm's greedy tokens of this checkout's engine")
    record.add_argument("--out", required=True)
    _add_record_args(record)
    compare = sub.add_parser("compare", help="compare two records; exit 1 on any difference")
    compare.add_argument("base_file", type=Path)
    compare.add_argument("current_file", type=Path)
    compare.add_argument("--md", type=Path, help="also write a markdown table here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.command == "record":
        return cmd_record(args)
    if args.command == "compare":
        return cmd_compare(args)
    if args.base:
        return cmd_base(args)
    build_parser().error("give a command (record, compare) or --base REV --out FILE.json")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
