#!/usr/bin/env bash
# kvarn bench on the bundled model: compute dtype x OpenBLAS on MLX's CPU backend, with the
# unquantized KV cache so that only the weights' dtype and the BLAS differ (docs/benchmarks.md).
# Usage: bash bench/cpu_dtypes.sh [OUT_DIR]   (default bench/results)
set -euo pipefail
out=${1:-bench/results}
mkdir -p "$out"
run() {  # name, then kvarn bench flags
  local name=$1; shift
  kvarn bench --kv-scheme fp16 "$@" --json "$out/$name.json" --markdown "$out/$name.md"
}
run fp32-openblas      --dtype float32
run fp32-reference     --dtype float32  --no-openblas --repeats 1
run bf16-openblas      --dtype bfloat16 --repeats 1
run bf16-reference     --dtype bfloat16 --no-openblas --repeats 1
# MLX's CPU quantized matmul is ~10x slower: a shorter run is enough to show it
run q8native-openblas  --dtype native --prefill-tokens 64 --depths 0 --decode-tokens 16 --repeats 1
