"""``kvarn advise``: which KV layout to serve a model with, measured on the model itself.

No data set and no calibration: the shipped generic prompts (``engine/data/kld_prompts.json``)
and the model's own greedy continuations, teacher-forced through every candidate layout in the
decode regime (``engine.kld.run_kld``: each candidate's cache is quantized as it grows, as when
serving). Each candidate gets its bytes per token, mean / p99 KL divergence from the unquantized
cache and top-1 agreement; the recommendation is the **smallest layout whose mean KLD is within
the budget** (``--max-kld``), the lower KLD first among layouts of equal bytes (so k3v3 before
k4v2 where k3v3 is closer). If no candidate is within the budget, the closest one is recommended
and the advice says so.

Advice is stored per model fingerprint under the user's cache directory
(``$XDG_CACHE_HOME/kvarn/advice/<fingerprint>.json``, else ``~/.cache/...``), which is what
``kvarn serve --kv-layout auto`` reads (and, if absent, measures once at start-up).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.kld import KldConfig, parse_arm, run_kld
from engine.loader import LoadedModel

CANDIDATES = ("kvarn:k8v8", "kvarn:k4v4", "kvarn:k4v3", "kvarn:k3v3", "kvarn:k4v2", "kvarn:k3v2", "kvarn:k2v2",
              "affine:8", "affine:4")
# mean nats: the smallest layout that stays this close to fp16 (mlx-lm's 4-bit affine cache costs
# 9e-3 to 1.8e-2 on the bundled model: docs/fidelity.md, docs/advice/advice.md)
DEFAULT_MAX_KLD = 1e-2
ADVICE_VERSION = 1


@dataclass(frozen=True)
class AdviceConfig:
    max_kld: float = DEFAULT_MAX_KLD
    arms: tuple[str, ...] = CANDIDATES
    num_prompts: int = 4
    prompt_tokens: int = 256
    gen_tokens: int = 512

    def kld_config(self) -> KldConfig:
        return KldConfig(self.arms, self.num_prompts, self.prompt_tokens, self.gen_tokens)


@dataclass
class Advice:
    """A measured table and its recommendation (``arm``: e.g. ``kvarn:k3v3``)."""

    model: str
    fingerprint: str
    config: AdviceConfig
    rows: list[dict[str, Any]]  # kvarn kld summaries, smallest bytes first
    fp16_bytes: float
    arm: str
    within_budget: bool
    seconds: float
    version: int = ADVICE_VERSION
    measured_on: str = field(default="")

    def kv_config(self):  # -> engine.KVConfig
        return parse_arm(self.arm)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "config": {**asdict(self.config), "arms": list(self.config.arms)}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Advice:
        if data.get("version") != ADVICE_VERSION:
            raise ValueError(f"advice version {data.get('version')}, not {ADVICE_VERSION}")
        config = AdviceConfig(**{**data["config"], "arms": tuple(data["config"]["arms"])})
        return cls(**{**data, "config": config})


def recommend(rows: list[dict[str, Any]], max_kld: float) -> tuple[str, bool]:
    """(arm, within budget): the fewest bytes per token among arms whose mean KLD is within
    ``max_kld`` (ties: the lower mean KLD); if none is, the lowest mean KLD."""
    fitting = [r for r in rows if r["mean_kld"] <= max_kld]
    if fitting:
        best = min(fitting, key=lambda r: (r["bytes_per_token"], r["mean_kld"]))
        return best["arm"], True
    return min(rows, key=lambda r: r["mean_kld"])["arm"], False


def advise(loaded: LoadedModel, config: AdviceConfig = AdviceConfig(),
           progress: Callable[[int], None] = lambda _: None) -> Advice:
    """Measure every candidate on ``loaded`` and recommend one (minutes on a CPU: see the README)."""
    start = time.perf_counter()
    results, fp16_bytes = run_kld(loaded, config.kld_config(), progress)
    rows = sorted((r.summary(fp16_bytes) for r in results), key=lambda r: (r["bytes_per_token"], r["mean_kld"]))
    arm, within = recommend(rows, config.max_kld)
    return Advice(loaded.model_id, loaded.fingerprint, config, rows, fp16_bytes, arm, within,
                  time.perf_counter() - start, measured_on=str(mx.default_device()))


def advice_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvarn" / "advice"


def stored_path(fingerprint: str, folder: Path | None = None) -> Path:
    return (folder or advice_dir()) / f"{fingerprint}.json"


def store(advice: Advice, folder: Path | None = None) -> Path:
    path = stored_path(advice.fingerprint, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(advice.to_json(), indent=2))
    os.replace(tmp, path)
    return path


def load_stored(fingerprint: str, folder: Path | None = None) -> Advice | None:
    """The stored advice for this model, or None (absent, or unreadable: then it is measured again)."""
    path = stored_path(fingerprint, folder)
    try:
        advice = Advice.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return advice if advice.fingerprint == fingerprint else None


# at start-up (``--kv-layout auto`` with no stored advice): half the prompts and positions of the
# default, ~2 minutes for the bundled model on 2 CPU cores
START_UP = AdviceConfig(num_prompts=2, prompt_tokens=256, gen_tokens=384)


def auto_layout(loaded: LoadedModel, folder: Path | None = None,
                config: AdviceConfig = START_UP) -> tuple[Any, dict[str, Any]]:
    """(KVConfig, where it came from) for ``--kv-layout auto``: the stored advice for this model,
    else measured now (``config``) and stored. Where it came from goes to ``/v1/models``."""
    advice = load_stored(loaded.fingerprint, folder)
    source = "stored advice"
    if advice is None:
        advice = advise(loaded, config)
        source = f"measured at start-up in {advice.seconds:.0f} s"
        try:
            store(advice, folder)
        except OSError as exc:  # a read-only cache folder: serve with the advice anyway
            source += f" (not stored: {exc})"
    row = next(r for r in advice.rows if r["arm"] == advice.arm)
    return advice.kv_config(), {"chosen_by": "kvarn advise", "source": source, "arm": advice.arm,
                                "max_kld": advice.config.max_kld, "mean_kld": row["mean_kld"],
                                "within_budget": advice.within_budget,
                                "path": str(stored_path(loaded.fingerprint, folder))}


def to_markdown(advice: Advice) -> str:
    c = advice.config
    head = (f"`kvarn advise` on `{advice.model}` ({advice.measured_on}, {advice.seconds:.0f} s): {c.num_prompts} "
            f"prompts x {c.prompt_tokens} tokens, {c.gen_tokens} teacher-forced decode positions each; reference: "
            f"unquantized KV (fp16 = {advice.fp16_bytes:.0f} B/token over all layers); budget: mean KLD <= "
            f"{c.max_kld:g}.\n\n")
    table = ["| arm | B/token | x vs fp16 | mean KLD | p99 KLD | top-1 | within budget |", "|---|---|---|---|---|---|---|"]
    for r in advice.rows:
        mark = " **(recommended)**" if r["arm"] == advice.arm else ""
        table.append(f"| {r['arm']}{mark} | {r['bytes_per_token']:.0f} | {r['compression_vs_fp16']:.2f} | "
                     f"{r['mean_kld']:.3e} | {r['p99_kld']:.2e} | {100 * r['top1_agreement']:.2f}% | "
                     f"{'yes' if r['mean_kld'] <= c.max_kld else 'no'} |")
    verdict = (f"\nRecommended: **{advice.arm}**, the fewest bytes per token within the budget.\n" if advice.within_budget
               else f"\nNo candidate is within the budget: **{advice.arm}** is the closest to fp16.\n")
    return head + "\n".join(table) + "\n" + verdict


def write_report(out_dir: Path, advice: Advice) -> str:
    """advice.md, advice.json and advice.png (mean KLD against bytes per token, the
    recommendation marked) under ``out_dir``; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = to_markdown(advice)
    (out_dir / "advice.md").write_text(markdown)
    (out_dir / "advice.json").write_text(json.dumps(advice.to_json(), indent=2))
    _plot(out_dir / "advice.png", advice)
    return markdown


def _plot(path: Path, advice: Advice) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in advice.rows:
        chosen = r["arm"] == advice.arm
        ax.scatter(r["bytes_per_token"], r["mean_kld"], s=90 if chosen else 40, marker="*" if chosen else "o",
                   color="crimson" if chosen else ("tab:blue" if r["arm"].startswith("kvarn") else "tab:gray"))
        ax.annotate(r["arm"], (r["bytes_per_token"], r["mean_kld"]), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    ax.axhline(advice.config.max_kld, color="crimson", linestyle="--", linewidth=1, label="budget (mean KLD)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes per token (all layers)")
    ax.set_ylabel("mean KL(fp16 || layout), nats")
    ax.set_title(f"{advice.model}: recommended {advice.arm}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
