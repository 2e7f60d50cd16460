#!/usr/bin/env bash
# HTTP serving throughput, kvarn serve vs mlx_lm.server, side by side on the bundled model.
#
# One server at a time on a free loopback port; each gets the same bench/serve_load.py run
# (concurrency LEVELS, then a burst of BURST simultaneous requests) and is then killed
# (whole process group). Writes bench/results/serving-<label>.json and bench/results/serving.md.
#
# Usage: bash bench/serving.sh
# Env:   LEVELS="1 4 16 64"  MAX_TOKENS=64  PROMPT_TOKENS=128  BURST=64  OUT=bench/results
#        REQUESTS=0      requests per level (0: max(2 x concurrency, 8))
#        KVARN_ARGS=""   extra args for every `kvarn serve`
#        MLX_ARGS=""     extra args for every mlx_lm.server (e.g. "--decode-concurrency 64")
#        SERVERS="..."   subset of labels to run (default: all, see ALL below); the table
#                        merges every serving-<label>.json found in OUT
#        F32_MODEL=/tmp/fixture-f32   where the float32 dequantized copy is made (outside the repo)
#
# Compute dtype differs by default: `kvarn serve` (--dtype auto) dequantizes the 8-bit weights
# to float32 on MLX's CPU backend, while mlx_lm.server computes with the stored weights
# (8-bit quantized matmuls, bf16 activations). The mlx-lm-f32* rows run mlx_lm.server on a
# float32 dequantized copy so the comparison is fair both ways.
#
# mlx_lm.server 0.32.2 defaults (kept unless MLX_ARGS overrides them):
#   continuous batching is on when the model's caches support it: --decode-concurrency 32
#   (at most 32 sequences decode together, vs kvarn's --max-num-seqs 64), --prompt-concurrency 8,
#   --prefill-step-size 2048, LRU prompt cache (prompts here are distinct), ThreadingHTTPServer
#   (listen backlog 5). --kv-bits DISABLES batching (requests are served one at a time), and
#   only quantizes once a sequence passes --quantized-kv-start (default 5000 tokens): the kv4
#   rows pass --quantized-kv-start 0 so the cache really is 4-bit from the first token.
#   MLX's Linux CPU wheel links a reference BLAS; mlx_lm.server gets Debian's OpenBLAS preloaded
#   here, exactly what `kvarn serve` does for itself by re-executing.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=engine/bundled/fixture-chat-29m-q8
LEVELS=${LEVELS:-"1 4 16 64"}
MAX_TOKENS=${MAX_TOKENS:-64}
PROMPT_TOKENS=${PROMPT_TOKENS:-128}
BURST=${BURST:-64}
REQUESTS=${REQUESTS:-0}
OUT=${OUT:-bench/results}
F32_MODEL=${F32_MODEL:-/tmp/fixture-f32}
KVARN_ARGS=${KVARN_ARGS:-}
MLX_ARGS=${MLX_ARGS:-}
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
# mlx-lm and mlx-lm-kv4 (8-bit weights, bf16 compute) come last: they are ~40x slower on CPU
ALL="kvarn-fp16 kvarn-affine4 kvarn-k4v2 mlx-lm-f32 mlx-lm-f32-kv4 mlx-lm mlx-lm-kv4"
SERVERS=${SERVERS:-$ALL}
LOGS=bench/out    # server logs (git-ignored)
mkdir -p "$OUT" "$LOGS"

server_pid=""
stop_server() {
  [[ -n "$server_pid" ]] || return 0
  kill -TERM -- "-$server_pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 -- "-$server_pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL -- "-$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}
trap stop_server EXIT INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port_busy() { ss -Hltn "sport = :$1" | grep -q .; }

# run_one LABEL MODEL_ID CMD...   (MODEL_ID "" = first of /v1/models; CMD gets --port P
# appended and runs in its own session, i.e. its own process group)
run_one() {
  local label=$1 model_id=$2; shift 2
  local port; port=$(free_port)
  echo "== $label: $* --port $port" >&2
  setsid "$@" --port "$port" >"$LOGS/serving-$label.log" 2>&1 &
  server_pid=$!
  local t0=$SECONDS
  until curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; do
    if ! kill -0 "$server_pid" 2>/dev/null || (( SECONDS - t0 > 180 )); then
      echo "!! $label did not become ready, see $LOGS/serving-$label.log" >&2
      tail -n 20 "$LOGS/serving-$label.log" >&2; stop_server; return 0
    fi
    sleep 1
  done
  # shellcheck disable=SC2086
  python3 bench/serve_load.py --url "http://127.0.0.1:$port" --label "$label" ${model_id:+--model "$model_id"} \
    --concurrency $LEVELS --requests-per-level "$REQUESTS" --max-tokens "$MAX_TOKENS" --prompt-tokens "$PROMPT_TOKENS" \
    --burst "$BURST" --json-out "$OUT/serving-$label.json" || echo "!! $label: load run failed" >&2
  stop_server
  table   # refreshed after every server, so an interrupted run still leaves a table
  for _ in $(seq 50); do port_busy "$port" || break; sleep 0.2; done
  if port_busy "$port"; then echo "!! port $port still in use after $label" >&2; exit 1; fi
}

wanted() { [[ " $SERVERS " == *" $1 "* ]]; }

# mlx_lm.server gets an absolute model path and the same string as the request's model id: its
# /v1/models also lists Hugging Face cache models, and any other id would load a second copy.
# HF_HUB_CACHE points at an empty folder: without a Hugging Face cache folder its /v1/models
# handler raises CacheNotFound after sending the 200 status line (empty body).
mlx() {
  local label=$1 model; model=$(realpath "$2"); shift 2
  mkdir -p "$LOGS/empty-hf-cache"
  # shellcheck disable=SC2086
  run_one "$label" "$model" env LD_PRELOAD="$OPENBLAS" HF_HUB_CACHE="$PWD/$LOGS/empty-hf-cache" \
    mlx_lm.server --model "$model" "$@" $MLX_ARGS
}

# every serving-<label>.json in OUT, so runs of subsets (SERVERS=...) add up to one table
table() {
  local files=() label
  for label in $ALL; do [[ -f "$OUT/serving-$label.json" ]] && files+=("$OUT/serving-$label.json"); done
  if (( ${#files[@]} )); then python3 bench/serving_table.py "${files[@]}" >"$OUT/serving.md"; fi
}

for label in $SERVERS; do [[ " $ALL " == *" $label "* ]] || { echo "unknown server label: $label" >&2; exit 2; }; done
# shellcheck disable=SC2086
{
  wanted kvarn-fp16    && run_one kvarn-fp16    "" kvarn serve "$MODEL" --kv-scheme fp16 $KVARN_ARGS
  wanted kvarn-affine4 && run_one kvarn-affine4 "" kvarn serve "$MODEL" --kv-scheme affine --kv-bits 4 $KVARN_ARGS
  wanted kvarn-k4v2    && run_one kvarn-k4v2    "" kvarn serve "$MODEL" --kv-scheme kvarn --kv-key-bits 4 --kv-value-bits 2 $KVARN_ARGS
  if wanted mlx-lm-f32 || wanted mlx-lm-f32-kv4; then
    [[ -f "$F32_MODEL/config.json" ]] || \
      python3 -m mlx_lm convert --hf-path "$MODEL" --mlx-path "$F32_MODEL" -d --dtype float32 >&2
    wanted mlx-lm-f32     && mlx mlx-lm-f32     "$F32_MODEL"
    wanted mlx-lm-f32-kv4 && mlx mlx-lm-f32-kv4 "$F32_MODEL" --kv-bits 4 --quantized-kv-start 0
  fi
  wanted mlx-lm     && mlx mlx-lm     "$MODEL"
  wanted mlx-lm-kv4 && mlx mlx-lm-kv4 "$MODEL" --kv-bits 4 --quantized-kv-start 0
  true
}
cat "$OUT/serving.md" 2>/dev/null || echo "no results" >&2
