#!/usr/bin/env bash
# One device session on the lent H200, in two calls made back to back (the machine stays warm):
#   bash bench/device_session.sh checks   # GPU tests of the kernels and the pool, commit cost, greedy tokens
#   bash bench/device_session.sh engine   # the 8B-shaped engine benchmark and the prefix cache
#   bash bench/device_session.sh prefill  # (a later session) the view's GPU tests, the engine at c = 1 and 32
#   bash bench/device_session.sh masked CHUNK  # session 19: chunk attention masked vs by tiles, the view's
#                                              # GPU tests, the engine at c = 1 and 32 with prompt chunks of CHUNK
#                                              # (WITH_APC=1: bench/device_apc.py before the engine; SKIP_CA=1: no chunk bench)
#   DEPTH=4096 bash bench/device_session.sh s26  # session 26: async scheduling: GPU tests, engine A/B (TESTS= skips the tests)
#   DEPTH=4096 bash bench/device_session.sh s27  # session 27: batched prefill: GPU tests, engine A/B (ARMS, TESTS= skips the tests)
#   bash bench/device_session.sh s24      # session 24: fp16 slots' flat scatter: GPU tests, engine, fp16 step profile
#   bash bench/device_session.sh s22      # session 22: in-place commit A/B, prefill steps, disk hit, no CUDA graphs
# Every call ends by packing MLX's compiled-kernel cache into $OUT (mlx-cuda-kit --ptx-cache takes it).
# Each step has its own time limit; logs and JSON land in $OUT (fetched back by the device tool).
set -uo pipefail
cd "$(dirname "$0")/.."
eval "$(bash .mlxcuda/install.sh)" || exit 9
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "${LOGS:-$OUT}/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-12}" "${LOGS:-$OUT}/$name.log"
}
case "${1:-}" in
  checks)
    step metal-tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/metal -k "not emulated" --durations=5
    step pool-tests 60 python3 -m pytest -q -x -p no:cacheprovider tests/kvarn/test_paged.py tests/engine/test_pool_tier.py
    step commit-cost 60 python3 bench/commit_cost.py --device --out "$OUT/commit-cost-h200.json"
    step greedy 120 python3 bench/device_greedy.py --out "$OUT/device-greedy-h200.json" --dtype float16
    ;;
  engine)
    step engine 430 python3 bench/device_engine.py --out "$OUT/device-engine-h200.json" --arms kvarn-k4v2,fp16 \
      --depths 4096,16384 --concurrency 1,16,32 --mlxlm stacked --time-budget 400
    TAIL=8 step apc 100 python3 bench/device_apc.py --out "$OUT/device-apc-h200.json" --arms kvarn-k4v2,fp16 \
      --prompts 2 --repeats 3
    ;;
  prefill)  # after the tile-cut prefill attention: GPU correctness of the view, then the engine again
    step view-tests 60 python3 -m pytest -q -x -p no:cacheprovider tests/kvarn/test_attention.py tests/kvarn/test_paged.py
    step engine 250 python3 bench/device_engine.py --out "$OUT/device-engine-h200-prefill.json" \
      --arms kvarn-k4v2,fp16 --depths 4096,16384 --concurrency 1,32 --mlxlm stacked --time-budget 230
    ;;
  masked)  # session 19: one masked attention call a chunk (cuDNN) instead of one a tile
    chunk=${2:-512}
    [ -z "${SKIP_CA:-}" ] && step chunk-attention 120 python3 bench/chunk_attention.py --out "$OUT/chunk-attention-h200.json"
    step view-tests 90 python3 -m pytest -q -x -p no:cacheprovider tests/kvarn/test_attention.py tests/kvarn/test_paged.py
    [ -n "${WITH_APC:-}" ] && TAIL=8 step apc 110 python3 bench/device_apc.py --out "$OUT/device-apc-h200.json" \
      --arms kvarn-k4v2,fp16 --prompts 2 --repeats 3
    TAIL=30 step engine "${ENGINE_S:-300}" python3 bench/device_engine.py --out "$OUT/device-engine-h200-chunk$chunk.json" \
      --arms kvarn-k4v2,fp16 --depths 4096,16384 --concurrency ${LEVELS:-1,32} --mlxlm stacked --chunk "$chunk" \
      --time-budget $(( ${ENGINE_S:-300} - 20 ))
    ;;
  s22)  # session 22: the in-place decode commit A/B through the engine (step profiles with prefill
        # steps timed), the prefix cache's disk hit after the format-3 read path, the commit step
        # without CUDA graphs (is its one-time cost graph instantiation?)
    sp="python3 bench/step_profile.py --arm kvarn-k4v2 --depth 4096 --rows 32 --commits 2 --kv-budget-gb 40"
    TAIL=20 step sp-inplace 150 $sp --out "$OUT/step-profile-h200-s22-inplace.json"
    TAIL=20 step sp-gather 130 $sp --out "$OUT/step-profile-h200-s22-gather.json" --set kvarn.pool.COMMIT_IN_PLACE=0
    TAIL=8 step apc 100 python3 bench/device_apc.py --out "$OUT/device-apc-h200-s22.json" --arms kvarn-k4v2,fp16 \
      --prompts 2 --repeats 3
    TAIL=20 step sp-nographs 120 env MLX_USE_CUDA_GRAPHS=0 $sp --out "$OUT/step-profile-h200-s22-nographs.json"
    ;;
  s22b)  # session 22, second call: the prefill again with every shape seen (kvarn and fp16), what a
         # new attention shape costs, the disk hit split into read and load, the bundled model's batching
    LOGS=/tmp/steplogs; mkdir -p $LOGS /tmp/batching  # the device tool brings back 8 files at most
    sp="python3 bench/step_profile.py --depth 4096 --rows 32 --commits 1 --kv-budget-gb 40 --prefill-rounds 2"
    TAIL=16 step sp-kvarn 130 $sp --arm kvarn-k4v2 --out "$OUT/step-profile-h200-s22-rounds-kvarn.json"
    TAIL=16 step sp-fp16 120 $sp --arm fp16 --out "$OUT/step-profile-h200-s22-rounds-fp16.json"
    TAIL=14 step sdpa 60 python3 bench/sdpa_shapes.py --out "$OUT/sdpa-shapes-h200.json"
    TAIL=4 step apc 80 python3 bench/device_apc.py --out "$OUT/device-apc-h200-s22b.json" --arms kvarn-k4v2,fp16 \
      --prompts 2 --repeats 3
    TAIL=16 step batching 140 python3 bench/device_batching.py --out /tmp/batching --dtype float16 --levels 16,64
    tar -C /tmp -czf "$OUT/batching.tar.gz" batching
    cat $LOGS/*.log > "$OUT/logs.txt"
    ;;
  s22c)  # session 22, third call: where a disk hit's read and load go (cProfile), the engine benchmark
         # with the in-place decode commit
    LOGS=/tmp/steplogs; mkdir -p $LOGS
    TAIL=3 step apc 80 python3 bench/device_apc.py --out "$OUT/device-apc-h200-s22c.json" --arms kvarn-k4v2 \
      --prompts 2 --repeats 3 --profile
    TAIL=30 step engine 400 python3 bench/device_engine.py --out "$OUT/device-engine-h200-s22.json" \
      --arms kvarn-k4v2,fp16 --depths 4096,16384 --concurrency 1,32 --mlxlm stacked --chunk 2048 --time-budget 380
    cat $LOGS/*.log > "$OUT/logs.txt"
    ;;
  s22d)  # session 22, fourth call: the disk hit with one host-to-device copy a read
    TAIL=3 step apc 80 python3 bench/device_apc.py --out "$OUT/device-apc-h200-s22d.json" --arms kvarn-k4v2,fp16 \
      --prompts 2 --repeats 3
    ;;
  s23a)  # session 23, first call: the commit kernel with reciprocal divisions (registers, GPU tests, cost,
          # Nsight Compute), the engine's warm-up before the 32-row step profile, the disk hit step by step
    LOGS=/tmp/steplogs; mkdir -p $LOGS
    TAIL=8 step compile 60 python3 bench/kernel_compile.py --only commit --sass /tmp/sass
    for f in /tmp/sass/commit-*.sass; do echo "$f $(grep -cE '^ +/\*[0-9a-f]{4}\*/' $f) instructions"; \
      grep -oE 'MUFU\.[A-Z0-9]+|FFMA|FMUL|FADD|SHFL\.BFLY|BAR\.SYNC|CALL\.REL[A-Z.]*|LDS|STS' $f | sort | uniq -c \
      | sort -rn | head -12 | tr '\n' ' '; echo; done > $LOGS/sass-counts.log 2>&1; cat $LOGS/sass-counts.log
    TAIL=6 step commit-tests 130 python3 -m pytest -q -x -p no:cacheprovider tests/metal/test_commit.py -k "not emulated"
    TAIL=8 step commit-cost 60 python3 bench/commit_cost.py --device --out "$OUT/commit-cost-h200-s23.json"
    for mk in 1 0; do
      TAIL=40 step ncu-commit-mk$mk 60 ncu --clock-control none --kernel-name regex:commit --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section Occupancy --section SchedulerStats \
        --section WarpStateStats --section InstructionStats --section ComputeWorkloadAnalysis \
        python3 bench/commit_ncu_target.py $mk
    done
    TAIL=30 step sp-warm 200 python3 bench/step_profile.py --arm kvarn-k4v2 --depth 4096 --rows 32 --commits 2 \
      --kv-budget-gb 40 --warm-up 2 --out "$OUT/step-profile-h200-s23-warm.json"
    TAIL=4 step apc 90 python3 bench/device_apc.py --out "$OUT/device-apc-h200-s23.json" --arms kvarn-k4v2,fp16 \
      --prompts 2 --repeats 3
    cat $LOGS/*.log > "$OUT/logs.txt"
    ;;
  s23b)  # session 23, second call: the engine benchmark with the engine's warm-up (as kvarn serve runs it on
          # a GPU) and the faster commit kernel; the disk hit with the load's device work timed apart
    LOGS=/tmp/steplogs; mkdir -p $LOGS
    TAIL=4 step apc 80 python3 bench/device_apc.py --out "$OUT/device-apc-h200-s23b.json" --arms kvarn-k4v2,fp16 \
      --prompts 2 --repeats 3 --eval-load
    TAIL=30 step engine 420 python3 bench/device_engine.py --out "$OUT/device-engine-h200-s23.json" \
      --arms kvarn-k4v2,fp16 --depths 4096,16384 --concurrency 1,32 --mlxlm stacked --chunk 2048 --time-budget 400
    cat $LOGS/*.log > "$OUT/logs.txt"
    ;;
  s24)  # session 24: the fp16 slots' flat scatter (fewer graph nodes a step): its GPU tests, the engine
        # benchmark beside mlx-lm, and where an fp16 step's time goes
    LOGS=/tmp/steplogs; mkdir -p $LOGS
    TAIL=6 step slot-tests 150 python3 -m pytest -q -x -p no:cacheprovider -n 0 tests/kvarn/test_slots.py \
      tests/metal/test_ragged_decode.py tests/engine/test_batching.py -k "not emulated"
    TAIL=30 step engine 420 python3 bench/device_engine.py --out "$OUT/device-engine-h200-s24.json" \
      --arms kvarn-k4v2,fp16 --depths 4096,16384 --concurrency 1,32 --mlxlm stacked --chunk 2048 --time-budget 400
    TAIL=20 step sp-fp16 150 python3 bench/step_profile.py --arm fp16 --depth 4096 --rows 32 --commits 0 \
      --kv-budget-gb 40 --warm-up 2 --out "$OUT/step-profile-h200-s24-fp16.json"
    cat $LOGS/*.log > "$OUT/logs.txt"
    ;;
  s26)  # session 26: async scheduling (the next step launched before this one is read back), its GPU tests,
        # the engine benchmark with and without it beside mlx-lm with and without its pipelining; DEPTH (4096)
    LOGS=/tmp/steplogs; mkdir -p $LOGS
    [ -n "${TESTS-1}" ] && TAIL=6 step async-tests 150 python3 -m pytest -q -x -p no:cacheprovider -n 0 \
      tests/engine/test_async_scheduling.py
    TAIL=40 step engine ${ENGINE_S:-500} python3 bench/device_engine.py --out "$OUT/device-engine-h200-s26-${DEPTH:-4096}.json" \
      --arms fp16,fp16-async,kvarn-k4v2,kvarn-k4v2-async --depths ${DEPTH:-4096} --concurrency 1,32 \
      --mlxlm stacked,stacked-async --chunk 2048 --time-budget $(( ${ENGINE_S:-500} - 20 ))
    cat $LOGS/*.log > "$OUT/logs.txt"
    ;;
  s27)  # session 27: a step's prompt chunks in one forward (batch_prefill) against one forward a chunk
        # (the -solo arms), its GPU tests, beside mlx-lm; DEPTH (4096), ARMS
    LOGS=/tmp/steplogs; mkdir -p $LOGS
    [ -n "${TESTS-1}" ] && TAIL=8 step prefill-tests 150 python3 -m pytest -q -x -p no:cacheprovider -n 0 \
      tests/kvarn/test_chunk_rows.py tests/engine/test_batch_prefill.py
    TAIL=40 step engine ${ENGINE_S:-440} python3 bench/device_engine.py --out "$OUT/device-engine-h200-s27-${DEPTH:-4096}.json" \
      --arms ${ARMS:-fp16,fp16-solo,kvarn-k4v2,kvarn-k4v2-solo} --depths ${DEPTH:-4096} --concurrency ${LEVELS:-1,32} \
      --mlxlm stacked --chunk 2048 --time-budget $(( ${ENGINE_S:-440} - 20 ))
    cat $LOGS/*.log > "$OUT/logs.txt"
    ;;
  *) echo "usage: $0 checks|engine|prefill|masked [CHUNK]|s22|s22b|s22c|s22d|s23a|s23b|s24|s26|s27" >&2; exit 2 ;;
esac
[ -n "${MLX_PTX_CACHE_DIR:-}" ] && [ -d "$MLX_PTX_CACHE_DIR" ] && tar -C "$MLX_PTX_CACHE_DIR" -cJf "$OUT/mlx-ptx-cache.tar.xz" . \
  && echo "== ptx cache: $(du -sh "$OUT/mlx-ptx-cache.tar.xz" | cut -f1)"
