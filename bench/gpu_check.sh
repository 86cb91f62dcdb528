#!/usr/bin/env bash
# The GPU check: one script for a developer who draws a GPU, run as a single device call from
# the repository root:
#     OUT=/tmp/out bash bench/gpu_check.sh          (the device tool sets $OUT)
# Sized to finish within one device call (600 s) on one H200, compilation included; each stage
# has its own time limit and a failing stage does not stop the others. Writes JSON per stage and
# $OUT/summary.md (a markdown table per stage) for BENCHMARKS.md.
#   0. the W4A16 expert kernel alone (bench.int4_gpu_check: STAGES=int4_w4a16)
#   1. compiled kernels vs references (bench.kernel_check)        exit status = correctness
#   2. kernel benchmarks with measured copy bandwidth / matmul rate (attention, MoE); the
#      quantized expert kernels (W4A16 INT4, W8A16 FP8) at Kimi K2.5 decode shapes (384 experts,
#      hidden 7168, expert width 2048, top-8; batch 1 and 64) against the dequantize-then-bf16
#      path, bytes of the hit experts as stored per second vs the measured copy bandwidth
#      (stage quant_experts); sampling at Kimi's vocabulary (candidate prefilter vs full sort)
#   3. end-to-end decode of a DeepSeek-V2-Lite-shaped random model at batch 1, 8, 64 against
#      the bandwidth floor, Mosaic GPU kernels (breakdown by ablation at batch 8), and the XLA
#      reference at batch 8
#   4. what a speculative verify forward over T = 2, 5, 9 positions per row costs in decode
#      steps on the same model (4 layers) and kernels (bench.decode_profile --verify); the demo
#      model with and without speculation
#   5. token-dispatch expert parallelism compiled on the device (ragged_all_to_all exchange)
#   6. the serving engine's speculative calls on the demo model (bench.spec_serving, no draft
#      model; last: its warm-up compiles and times every bucket; its JSON is written after
#      each workload, so a stage cut short by its limit keeps the workloads it finished)
# The stage limits add up to more than one device call may run (600 s), so the script keeps a
# deadline: each stage gets min(its limit, what is left of BUDGET_S less a reserve for the
# summary) and a stage with under 30 s left is skipped (named in summary.md). STAGES picks
# stages by name for a session that needs only some (they then share the whole budget, each
# keeping at least its limit for those after it), e.g. the speculative issue's:
#     STAGES=verify_cost,speculative,spec_serving OUT=/tmp/out bash bench/gpu_check.sh
set -u
OUT=${OUT:-/tmp/moejax_gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
PY=${PY:-python3}
# Smoke run of the plumbing on a CPU: MODEL=tiny KERNELS=reference bash bench/gpu_check.sh
MODEL=${MODEL:-dsv2_lite}
KERNELS=${KERNELS:-mosaic_gpu}
BUDGET_S=${BUDGET_S:-570}   # whole script, summary included; the device tool stops at 600 s
STAGES=${STAGES:-}          # comma-separated stage names; empty = every stage
# Every stage in order with its limit when all run (keep in step with the calls below).
ORDER="int4_w4a16:300 kernel_check:120 attention:90 moe:90 quant_experts:120 sampling:30 e2e_kernels:150
e2e_reference:60 verify_cost:90 speculative:120 dispatch:60 spec_serving:150"
status=0
selected() { [ -z "$STAGES" ] || [[ ",$STAGES," == *",$1,"* ]]; }
later_limits() {  # the limits of the selected stages after $1
  local sum=0 after=0 entry
  for entry in $ORDER; do
    if [ "$after" = 1 ] && selected "${entry%%:*}"; then sum=$((sum + ${entry##*:})); fi
    [ "${entry%%:*}" = "$1" ] && after=1
  done
  echo $sum
}
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  selected "$name" || return 0
  local left=$((BUDGET_S - 20 - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "=== $name: skipped, ${left}s of the budget left ===" | tee -a "$OUT/skipped.txt"
    status=1
    return
  fi
  # A chosen few stages share the budget: each may run past its limit by what the later ones
  # leave (compiling the speculative programs for the GPU may take longer than the CPU guess).
  if [ -n "$STAGES" ]; then
    local spare=$((left - $(later_limits "$name")))
    [ "$spare" -gt "$limit" ] && limit=$spare
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name (limit ${limit}s) ==="
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0))s ===" | tee -a "$OUT/stages.txt"
  [ "$rc" = 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null > "$OUT/commit.txt"
# The W4A16 expert kernel (issue 52): correctness, sweep and per-kernel times at K2.5 shapes,
# SASS counts; rows in $OUT/results.jsonl (bench/int4_gpu_check.py).
stage int4_w4a16 300 $PY -m bench.int4_gpu_check "$OUT"
stage kernel_check 120 $PY -m bench.kernel_check --out="$OUT/kernel_check.json"
stage attention 90 $PY -m bench.attention_kernels --out "$OUT/attention.json"
stage moe 90 $PY -m bench.moe_kernels --out "$OUT/moe.json" --tokens 1 8 64 512 8192
stage quant_experts 120 $PY -m bench.moe_kernels --out "$OUT/quant_experts.json" --tokens 1 64 \
  --experts 384 --formats int4 fp8 --iters 3 --reps 5
stage sampling 30 $PY -m bench.sampling --vocab=163840 --rows=1,8,40,320 --out="$OUT/sampling.json"
stage e2e_kernels 150 $PY -m bench.decode_profile --model=$MODEL --batch=1,8,64 --ablate=8 \
  --kernels=$KERNELS --nohost --iters=5 --out="$OUT/e2e_kernels.json"
stage e2e_reference 60 $PY -m bench.decode_profile --model=$MODEL --batch=8 --ablate= \
  --kernels=reference --nohost --iters=5 --out="$OUT/e2e_reference.json"
# (4 layers: each 27-layer program took ~95 s to compile on the H200; the ratios are per layer
# but for the embedding and head)
stage verify_cost 90 $PY -m bench.decode_profile --model=$MODEL --layers=${VERIFY_LAYERS:-4} \
  --batch=1,8 --ablate= --verify=2,5,9 --kernels=$KERNELS --nohost --iters=5 \
  --out="$OUT/verify_cost.json"
if [ -f bench/speculative.py ]; then
  stage speculative 120 $PY -m bench.speculative --methods=ngram,learned,mtp --num_draft=4 \
    --rounds=3 --learning_curve=3 --out="$OUT/speculative.json"
fi
stage dispatch 60 $PY -m bench.dispatch_check --out="$OUT/dispatch.json"
stage spec_serving 150 $PY -m bench.spec_serving --modes=off,ngram,learned,auto \
  --draft_checkpoint= --repeats=2 --out="$OUT/spec_serving.json"
{ cat "$OUT/stages.txt" "$OUT/skipped.txt" 2>/dev/null | sed 's/^/    /'; echo
  $PY -m bench.summarize "$OUT"; } > "$OUT/summary.md" 2>&1 || status=1
cat "$OUT/summary.md"
exit $status
