#!/usr/bin/env bash
# Decode tokens/s at depth 1k/2k/4k for each KV layout, side by side in one run (docs/benchmarks.md).
# Usage: bash bench/kv_layouts.sh [OUT_DIR]   (default bench/results)
set -euo pipefail
out=${1:-bench/results}
mkdir -p "$out"
for layout in "fp16" "kvarn --kv-key-bits 4 --kv-value-bits 2" "kvarn --kv-bits 4" "affine --kv-bits 4"; do
  name=$(echo "$layout" | tr -d '-' | tr ' ' '_')
  # shellcheck disable=SC2086
  kvarn bench --kv-scheme $layout --depths 1024,2048,4096 --decode-tokens 32 \
    --json "$out/kv-$name.json" --markdown "$out/kv-$name.md"
done
python3 bench/commit_cost.py | tee "$out/commit-cost.md"
