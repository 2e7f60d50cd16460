#!/usr/bin/env bash
# GPU measurements on an NVIDIA machine with MLX's CUDA backend (`.mlxcuda/install.sh`), one mode a call:
#   bash bench/device.sh checks         # GPU tests of the kernels and the pool, greedy tokens fused vs reference
#   bash bench/device.sh engine         # the 8B-shaped engine benchmark beside mlx-lm, and where an fp16 step goes
#                                               #   (CHUNK: prompt chunk, 2048; DEPTHS: 4096,16384; LEVELS: 1,32)
#   bash bench/device.sh async          # async scheduling on and off, beside mlx-lm's pipelined step (DEPTH: 4096)
#   bash bench/device.sh batch-prefill  # a step's prompt chunks in one forward vs one forward a chunk (DEPTH, ARMS)
#   bash bench/device.sh prefill        # prefill with every shape seen, the cost of a new attention shape,
#                                               #   one masked attention call a chunk vs one a tile
#   bash bench/device.sh commit         # the commit kernel: registers, GPU tests, cost, Nsight Compute, and the
#                                               #   commit step through the engine after its warm-up
#   bash bench/device.sh commit-ab      # the decode commit step with CUDA graphs on and off
#   bash bench/device.sh apc            # the prefix cache's TTFT: cold, memory hit, disk hit after a restart
#   bash bench/device.sh batching       # the bundled model's continuous batching and batched-vs-alone parity
#   bash bench/device.sh speculative    # speculative decoding off / ngram / oracle (/ draft) in one process, the
#                                               #   bundled model then the 8B shape (ROUNDS: 5; LAYOUT: kvarn-k4v2)
# TESTS= skips a mode's GPU tests. Every call ends by packing MLX's compiled-kernel cache into $OUT
# (mlx-cuda-kit --ptx-cache takes it). Each step has its own time limit; logs and JSON land in $OUT,
# named as in bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
eval "$(bash .mlxcuda/install.sh)" || exit 9
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}
# result files are named by the card that ran them (h100, h200; "gpu" for another)
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -oiE 'h[0-9]{3}' | tr 'A-Z' 'a-z')
CARD=${CARD:-gpu}
LOGS=/tmp/steplogs
mkdir -p "$OUT" "$LOGS"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-12}" "$LOGS/$name.log"
}
tests() {  # tests NAME SECONDS PYTEST-ARGS...: skipped with TESTS=
  [ -n "${TESTS-1}" ] || return 0
  local name=$1 limit=$2; shift 2
  TAIL=6 step "$name" "$limit" python3 -m pytest -q -x -p no:cacheprovider -n 0 "$@"
}
engine() {  # engine SECONDS OUT-NAME DEVICE_ENGINE-ARGS...
  local limit=$1 name=$2; shift 2
  TAIL=40 step engine "$limit" python3 bench/device_engine.py --out "$OUT/$name" --mlxlm "${MLXLM:-stacked}" \
    --chunk "${CHUNK:-2048}" --time-budget $(( limit - 20 )) "$@"
}
case "${1:-}" in
  checks)
    tests metal-tests 150 tests/metal -k "not emulated" --durations=5
    tests pool-tests 60 tests/kvarn/test_paged.py tests/engine/test_pool_tier.py
    step greedy 120 python3 bench/device_greedy.py --out "$OUT/device-greedy-$CARD.json" --dtype float16
    ;;
  engine)
    tests slot-tests 150 tests/kvarn/test_slots.py tests/metal/test_ragged_decode.py tests/engine/test_batching.py \
      -k "not emulated"
    name=device-engine-$CARD.json
    [ "${CHUNK:-2048}" != 2048 ] && name=device-engine-$CARD-chunk$CHUNK.json
    engine "${ENGINE_S:-420}" "$name" --arms kvarn-k4v2,fp16 --depths "${DEPTHS:-4096,16384}" \
      --concurrency "${LEVELS:-1,32}"
    TAIL=20 step sp-fp16 150 python3 bench/step_profile.py --arm fp16 --depth 4096 --rows 32 --commits 0 \
      --kv-budget-gb 40 --warm-up 2 --out "$OUT/step-profile-$CARD-fp16.json"
    ;;
  async)
    tests async-tests 150 tests/engine/test_async_scheduling.py
    MLXLM=stacked,stacked-async engine "${ENGINE_S:-500}" "device-engine-$CARD-async-${DEPTH:-4096}.json" \
      --arms fp16,fp16-async,kvarn-k4v2,kvarn-k4v2-async --depths "${DEPTH:-4096}" --concurrency 1,32
    ;;
  batch-prefill)
    tests prefill-tests 150 tests/kvarn/test_chunk_rows.py tests/engine/test_batch_prefill.py
    engine "${ENGINE_S:-440}" "device-engine-$CARD-batch-prefill-${DEPTH:-4096}.json" \
      --arms "${ARMS:-fp16,fp16-solo,kvarn-k4v2,kvarn-k4v2-solo}" --depths "${DEPTH:-4096}" --concurrency "${LEVELS:-1,32}"
    ;;
  prefill)
    sp="python3 bench/step_profile.py --depth 4096 --rows 32 --commits 1 --kv-budget-gb 40 --prefill-rounds 2"
    TAIL=16 step sp-kvarn 130 $sp --arm kvarn-k4v2 --out "$OUT/step-profile-$CARD-prefill-rounds-kvarn.json"
    TAIL=16 step sp-fp16 120 $sp --arm fp16 --out "$OUT/step-profile-$CARD-prefill-rounds-fp16.json"
    TAIL=14 step sdpa 60 python3 bench/sdpa_shapes.py --out "$OUT/sdpa-shapes-$CARD.json"
    step chunk-attention 120 python3 bench/chunk_attention.py --out "$OUT/chunk-attention-$CARD.json"
    ;;
  commit)
    TAIL=8 step compile 60 python3 bench/kernel_compile.py --only commit --sass /tmp/sass
    for f in /tmp/sass/commit-*.sass; do echo "$f $(grep -cE '^ +/\*[0-9a-f]{4}\*/' $f) instructions"; \
      grep -oE 'MUFU\.[A-Z0-9]+|FFMA|FMUL|FADD|SHFL\.BFLY|BAR\.SYNC|CALL\.REL[A-Z.]*|LDS|STS' $f | sort | uniq -c \
      | sort -rn | head -12 | tr '\n' ' '; echo; done > $LOGS/sass-counts.log 2>&1; cat $LOGS/sass-counts.log
    tests commit-tests 130 tests/metal/test_commit.py -k "not emulated"
    TAIL=8 step commit-cost 60 python3 bench/commit_cost.py --device --out "$OUT/commit-cost-$CARD.json"
    for mk in 1 0; do
      TAIL=40 step ncu-commit-mk$mk 60 ncu --clock-control none --kernel-name regex:commit --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section SchedulerStats \
        --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis \
        python3 bench/commit_ncu_target.py $mk
    done
    TAIL=30 step sp-warm 200 python3 bench/step_profile.py --arm kvarn-k4v2 --depth 4096 --rows 32 --commits 2 \
      --kv-budget-gb 40 --warm-up 2 --out "$OUT/step-profile-$CARD-commit.json"
    ;;
  commit-ab)
    sp="python3 bench/step_profile.py --arm kvarn-k4v2 --depth 4096 --rows 32 --commits 2 --kv-budget-gb 40"
    TAIL=20 step sp-inplace 150 $sp --out "$OUT/step-profile-$CARD-commit-inplace.json"
    TAIL=20 step sp-nographs 120 env MLX_USE_CUDA_GRAPHS=0 $sp --out "$OUT/step-profile-$CARD-commit-nographs.json"
    ;;
  apc)
    TAIL=8 step apc 110 python3 bench/device_apc.py --out "$OUT/device-apc-$CARD.json" --arms kvarn-k4v2,fp16 \
      --prompts 4 --repeats 3
    TAIL=8 step apc-eval-load 90 python3 bench/device_apc.py --out "$OUT/device-apc-$CARD-eval-load.json" \
      --arms kvarn-k4v2 --prompts 4 --repeats 2 --eval-load
    ;;
  batching)
    TAIL=16 step batching 140 python3 bench/device_batching.py --out /tmp/batching --dtype float16 --levels 16,64
    cp /tmp/batching/device-batching.json "$OUT/device-batching-$CARD.json"
    ;;
  speculative)
    spec="python3 bench/device_speculative.py --rounds ${ROUNDS:-5} --layout ${LAYOUT:-kvarn-k4v2}"
    TAIL=24 step spec-bundled "${BUNDLED_S:-150}" $spec --model bundled --time-budget $(( ${BUNDLED_S:-150} - 15 )) \
      --out "$OUT/speculative-{card}-bundled.json"
    TAIL=24 step spec-8b "${SPEC8B_S:-330}" $spec --model 8b --time-budget $(( ${SPEC8B_S:-330} - 15 )) \
      --out "$OUT/speculative-{card}-8b.json"
    ;;
  *) echo "usage: $0 checks|engine|async|batch-prefill|prefill|commit|commit-ab|apc|batching|speculative" >&2; exit 2 ;;
esac
cat $LOGS/*.log > "$OUT/logs.txt"
[ -n "${MLX_PTX_CACHE_DIR:-}" ] && [ -d "$MLX_PTX_CACHE_DIR" ] && tar -C "$MLX_PTX_CACHE_DIR" -cJf "$OUT/mlx-ptx-cache.tar.xz" . \
  && echo "== ptx cache: $(du -sh "$OUT/mlx-ptx-cache.tar.xz" | cut -f1)"
