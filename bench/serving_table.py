"""Merge bench/serve_load.py JSON reports into one markdown table.

Rows: server label; columns: aggregate generated tokens/s at each concurrency level (failed
requests noted in brackets), p50 TTFT at the lowest level, and burst ok/failed.
Usage: python bench/serving_table.py bench/results/serving-*.json > bench/results/serving.md
"""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> None:
    reports = [json.load(open(p)) for p in paths]
    levels = sorted({lv["concurrency"] for r in reports for lv in r["levels"]})
    bursts = sorted({r["burst"]["burst"] for r in reports if r.get("burst")})
    head = ["server"] + [f"c={c} tok/s" for c in levels] + [f"TTFT p50 ms (c={levels[0]})" if levels else ""]
    head += [f"burst {b} ok/failed" for b in bursts]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in reports:
        by_c = {lv["concurrency"]: lv for lv in r["levels"]}
        cells = [r["label"]]
        for c in levels:
            lv = by_c.get(c)
            cells.append("-" if lv is None else f"{lv['agg_tps']:.1f}" + (f" ({lv['failed']} failed)" if lv["failed"] else ""))
        first = by_c.get(levels[0]) if levels else None
        cells.append("-" if not first or first["ttft_p50_s"] is None else f"{first['ttft_p50_s'] * 1e3:.0f}")
        b = r.get("burst")
        for n in bursts:
            if b and b["burst"] == n:
                errs = ", ".join(f"{k}: {v}" for k, v in b["errors"].items())
                cells.append(f"{b['ok']}/{b['failed']}" + (f" ({errs})" if errs else ""))
            else:
                cells.append("-")
        print("| " + " | ".join(cells) + " |")
    settings: dict[str, list[str]] = {}
    for r in reports:
        a = r["args"]
        key = f"prompt ~{a['prompt_tokens']} tokens, max_tokens {a['max_tokens']}, stream={a['stream']}"
        settings.setdefault(key, []).append(r["label"])
    print("\ntemperature 0; tok/s = completion tokens / wall time of the level.")
    for key, labels in settings.items():
        print(f"{key}" + (f" ({', '.join(labels)})" if len(settings) > 1 else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
