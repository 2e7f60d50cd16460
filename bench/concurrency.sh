#!/usr/bin/env bash
# Aggregate tokens/s of the engine at several concurrency levels, for fp16, affine-4 and KVarN
# k4v2 side by side in one run (in-process: `kvarn bench --concurrency`, no HTTP).
# Writes bench/results/concurrency-<layout>.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."
LEVELS=${LEVELS:-1,4,16,64}
DECODE=${DECODE:-64}
PROMPT=${PROMPT:-128}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
run() {
  local label=$1; shift
  kvarn bench --concurrency "$LEVELS" --concurrency-prompt-tokens "$PROMPT" --decode-tokens "$DECODE" "$@" \
    --json "$OUT/concurrency-$label.json" --markdown "$OUT/concurrency-$label.md"
}
run fp16 --kv-scheme fp16
run affine4 --kv-scheme affine --kv-bits 4
run kvarn-k4v2 --kv-scheme kvarn --kv-key-bits 4 --kv-value-bits 2
