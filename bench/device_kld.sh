#!/usr/bin/env bash
# Run `kvarn kld` on a GPU (MLX CUDA), from the repo root, after `eval "$(bash .mlxcuda/install.sh)"`.
# Usage: bash bench/device_kld.sh OUT_DIR [kvarn kld flags...]
set -euo pipefail
out=$1; shift
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY'
import mlx.core as mx
print("device:", mx.default_device())
x = mx.random.normal((2, 2, 1, 4, 128)); w = mx.random.normal((2, 2, 1, 128, 256))
wq, s, b = mx.quantize(mx.swapaxes(w, -1, -2), group_size=128, bits=4)
print("qmm transpose=True ok", mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=128, bits=4).shape)
wq2, s2, b2 = mx.quantize(w, group_size=128, bits=4)
print("qmm transpose=False ok", mx.quantized_matmul(x, wq2, s2, b2, transpose=False, group_size=128, bits=4).shape)
PY
python3 -m server.cli kld --dtype float32 --out "$out" "$@"
