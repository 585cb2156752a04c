#!/usr/bin/env bash
# `make bench-gpu`: the GPU set (benchmarks/bench_gpu.py) run by the python given, records to the
# folder given. No make, venv or install needed: on the GPU machine
#
#   benchmarks/bench_gpu.sh python3 results                 # ~8 minutes on one H100
#   benchmarks/bench_gpu.sh python3 results --only attention fused_ops_rope
#   benchmarks/bench_gpu.sh .venv/bin/python "" --smoke     # here: every item at tiny sizes on the CPU
#
# Arguments: PYTHON (default python3), OUT (default results; "" = bench_gpu.py's default), then any
# bench_gpu.py options. Megatron-LM's pair needs MEGATRON_LM_PATH (a core_v0.16.1 checkout).
set -u
PY=${1:-python3}
OUT=${2-results}
shift $(( $# < 2 ? $# : 2 ))
cd "$(dirname "$0")/.." || exit 2
exec "$PY" benchmarks/bench_gpu.py ${OUT:+--out "$OUT"} "$@"
