#!/usr/bin/env bash
# Automatic prefix cache over HTTP: TTFT cold / memory hit / disk hit after a restart, and the hit
# rate and wall time of a multi-turn agent workload with and without the cache, against real
# `kvarn serve` processes (bench/apc.py starts and stops them, one at a time, on free ports).
# Writes bench/results/apc.json and bench/results/apc.md; server logs in bench/out/.
#
# Usage: bash bench/apc.sh [bench/apc.py flags]     e.g.  bash bench/apc.sh --schemes kvarn
#        python3 bench/apc.py --help                 lists every flag
set -euo pipefail
cd "$(dirname "$0")/.."
export APC_BENCH_COMMAND="bash bench/apc.sh${*:+ $*}"
exec python3 bench/apc.py "$@"
