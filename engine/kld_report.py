"""Reports of ``kvarn kld``: markdown table, JSON and a PNG plot of KLD against position."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from engine.kld import ArmResult, KldConfig


def summaries(results: list[ArmResult], fp16_bytes: float) -> list[dict[str, Any]]:
    return [r.summary(fp16_bytes) for r in results]


def to_markdown(rows: list[dict[str, Any]], config: KldConfig, model: str, fp16_bytes: float) -> str:
    head = (f"`kvarn kld` on `{model}`: {config.num_prompts} prompts x {config.prompt_tokens} prompt tokens, "
            f"{config.gen_tokens} teacher-forced decode positions each; reference: unquantized KV "
            f"(fp16 = {fp16_bytes:.0f} B/token over all layers)"
            + (f"; every arm without a window of its own attends at most {config.max_kv_size} tokens "
               f"(`--max-kv-size {config.max_kv_size}`, arms named `:w{config.max_kv_size}`)"
               if config.max_kv_size is not None else "") + ".\n\n")
    table = ["| arm | mean KLD | median | p99 | max | top-1 | greedy agree (mean / min tokens) | B/token | x vs fp16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['arm']} | {r['mean_kld']:.3e} | {r['median_kld']:.2e} | {r['p99_kld']:.2e} | "
                     f"{r['max_kld']:.3f} | {100 * r['top1_agreement']:.2f}% | "
                     f"{r['greedy_agree_tokens_mean']:.0f} / {r['greedy_agree_tokens_min']} | "
                     f"{r['bytes_per_token']:.0f} | {r['compression_vs_fp16']:.2f} |")
    return head + "\n".join(table) + "\n"


def write_reports(out_dir: Path, results: list[ArmResult], fp16_bytes: float, config: KldConfig,
                  model: str) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summaries(results, fp16_bytes)
    markdown = to_markdown(rows, config, model, fp16_bytes)
    (out_dir / "kld.md").write_text(markdown)
    (out_dir / "kld.json").write_text(json.dumps({"model": model, "config": vars(config), "arms": rows,
                                                  "layouts": {r.arm: r.layout for r in results}}, indent=2))
    _plot(out_dir / "kld.png", results)
    return markdown


def _plot(path: Path, results: list[ArmResult], window: int = 64) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in results:
        curve = r.kld.mean(axis=0)
        smooth = np.convolve(curve, np.ones(window) / window, mode="valid") if curve.size > window else curve
        ax.plot(np.arange(smooth.size) + (curve.size - smooth.size), smooth, label=r.arm)
    ax.set_yscale("log")
    ax.set_xlabel("decode position (tokens after the prompt)")
    ax.set_ylabel(f"KL(fp16 || arm), mean over prompts, {window}-token moving average")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
