#!/usr/bin/env bash
# The plan's GPU checks (docs/plan.md, "On a GPU") in one prepared device call, memory only, so the
# runs share the GPU (about 3 minutes on an H200 after start-up):
#
#   benchmarks/gpu/carry.sh /path/to/Megatron-LM   # here, once: .whl and .gpu
#   # then one device call, carrying .whl and .gpu:   bash benchmarks/gpu/plan_check.sh
#
# Writes $OUT/plan-check.tgz (or /tmp/plan-check.tgz without $OUT): results/ with
# megatron-lm-memory-cuda.json, compare-plan-*-cuda.json and test-cuda-plan.json, and every run's log.
# Here: unpack, copy the records into results/, `make docs`; `make test` then holds the plan to them
# (tests/plan/test_plan_on_a_gpu.py).
set -u
cd "$(dirname "$0")/../.."
T0=$(date +%s)
source benchmarks/gpu/machine.sh || { echo "setup failed"; exit 1; }
W=/tmp/plan-check
rm -rf "$W"
mkdir -p "$W/results" "$W/logs"
export MINDSPEED_LIKE_RESULTS=$W/results OMP_NUM_THREADS=2 W
finish() { tar czf "${OUT:-/tmp}/plan-check.tgz" -C /tmp plan-check 2>/dev/null; }
trap finish EXIT
( timeout 300 python3 -m mindspeed_like.plan.megatron_lm_device_check --measure --jobs 3 --timeout 200 \
    --logs "$W/logs/megatron-lm" > "$W/megatron-lm.log" 2>&1; echo "megatron-lm rc $?" >> "$W/megatron-lm.log" ) &
C="--num-layers 4 --hidden-size 1024 --num-attention-heads 8 --seq-length 2048 --micro-batch-size 1 --steps 4 --repeats 1"
cat > "$W/compares.txt" <<LIST
compare-plan-deepseek-level2-cuda --preset deepseek $C --optimization-level 2
compare-plan-moe-level2-cuda --preset moe $C --optimization-level 2
compare-plan-qwen3-moe-level2-cuda --preset qwen3-moe $C --optimization-level 2
compare-plan-llama-level1-cuda --preset llama $C --optimization-level 1
compare-plan-llama-level2-cuda --preset llama $C --optimization-level 2
compare-plan-llama-local-level2-cuda --preset llama $C --transformer-impl local --optimization-level 2
compare-plan-gpt-level2-cuda --preset gpt $C --optimization-level 2
compare-plan-deepseek-level1-cuda --preset deepseek $C --optimization-level 1
LIST
run_compare() {
  name=$1; shift
  s=$(date +%s)
  TORCHDYNAMO_DISABLE=0 timeout 200 python3 -m mindspeed_like.cli compare --device cuda "$@" --record "$name" --quiet \
    > "$W/logs/$name.log" 2>&1
  echo "$name rc $? $(( $(date +%s) - s )) s" >> "$W/compare.log"
}
export -f run_compare
( xargs -P 4 -L 1 -a "$W/compares.txt" bash -c 'run_compare "$@"' _ ) &
( TORCHDYNAMO_DISABLE=0 MINDSPEED_LIKE_TEST_DEVICE=cuda MINDSPEED_LIKE_LANE_RECORD=$W/results/test-cuda-plan.json \
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests/cuda/test_lane_plan.py \
  > "$W/lane.log" 2>&1; echo "lane rc $?" >> "$W/lane.log" ) &
wait
echo "== total $(( $(date +%s) - T0 )) s"
grep -v Warning "$W/megatron-lm.log" | tail -n 12
cat "$W/compare.log"
grep -E "passed|failed|^E .*plan " "$W/lane.log" | tail -n 12
