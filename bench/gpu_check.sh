#!/usr/bin/env bash
# The GPU protocol: one device call that always returns numbers. From the repository root:
#     OUT=gpu_out bash bench/gpu_check.sh               (the device tool sets $OUT; required)
#     DRY_RUN=1 OUT=gpu_dry bash bench/gpu_check.sh     (CPU: every stage at toy shapes, the
#                                                        Mosaic GPU kernels interpreted, the
#                                                        GPU programs lowered for CUDA)
# Writes exactly four files to $OUT:
#   run.log        everything printed (this script's output is tee'd into it)
#   results.jsonl  one JSON row per measurement, appended and fsynced as measured (device, jax
#                  version, commit, stage, impl, case, us, bytes, GB/s, fractions of this run's
#                  ceilings, dry_run; `bench/protocol/rows.py`), a `stage_end` row per stage
#   raw.tgz        raw dumps (the int4 stage's SASS and ptxas reports, nvidia-smi -q, pip list),
#                  repacked after every stage
#   summary.md     tables from results.jsonl (`bench/summarize.py`), under 10,000 characters,
#                  printed last (a device call returns only the end of its output)
# Stages, in priority order, each one Python process with its own time limit (a stage cut at
# its limit keeps every row it wrote; the next starts on time):
#   ceilings (25 s)   XLA copy, read-only reduction, bf16 matmul: the fractions' denominators
#   int4 (150 s)      the W4A16 expert kernel (protocol/int4.py): its register plan bitwise and
#                     the MoE call against the reference, a configuration sweep at E 384 x 1
#                     token (cut by its deadline), E 384 at 1/8/64 tokens and a shard of 48 at
#                     1/8, each kernel timed alone; SASS opcode counts (~26 programs)
#   k25_slice (160 s) Kimi K2.5-shaped 4-layer slice: decode at B 1/8/64 with the kernel
#                     breakdown and bytes floor, an 8,192-token prefill chunk, verify T[B, k]
#                     until its deadline
#   mla (55 s)        MLA decode at K2.5 shapes, split sweep, page 16 vs 64
#   experts (40 s)    FP8 and bf16 experts
#   peers (30 s)      torch cuBLAS bf16 and tinygemm W4A16 on the same bytes (python3 with
#                     torch; a skip row without it)
# BUDGET_S (480; dry run 300) bounds the whole script: a stage gets min(its limit, what is
# left less 15 s for the summary); one with under 20 s left writes a skip row. STAGES=a,b
# runs only those (sharing the budget: each may run past its limit by what the later ones
# leave); extra stages by name, run right after the ceilings: kernel_check (every compiled
# kernel against its reference; a kernel issue's session: STAGES=ceilings,kernel_check,int4
# or ...,mla: without the ceilings a stage has no fractions), layers (120 s; issue 49,
# protocol/layers.py: decode step time of the scanned layer stack against the layers as
# separate arrays and unrolled on an 8-layer K2.5-width slice of 48 experts at B 1 and 64,
# the scanned program's per-layer slice-copy bytes, lower + compile seconds at 4 and 61
# tiny layers scanned and unrolled; STAGES=ceilings,layers), eagle3 (120 s; issue 55,
# protocol/eagle3.py: K2.5-shaped EAGLE-3 heads, MLA and MHA, full 163,840 and 32,000 draft
# vocabularies: the first pass over a verified block and one chained draft step at B 1/8/64,
# the lm_head alone, one target decode step on a 3-MoE-layer K2.5 slice scaled to 61 layers
# plus its lm_head, and the ratios draft step / target step, K x that;
# STAGES=ceilings,eagle3 BUDGET_S=200). Exit status 0
# when every stage run wrote at least one row or a skip row (`bench.protocol.rows check`).
# QUICK=1 with DRY_RUN=1: each stage's first case and first CUDA lowering only (the CI test).
# LIMITS="mla:120,..." sets stage limits outright (still within the budget).
# COMMIT labels the rows (default: git rev-parse, absent on the device's copy of the tree).
set -u
: "${OUT:?set OUT to the output directory}"
mkdir -p "$OUT"
rm -f "$OUT/run.log" "$OUT/results.jsonl" "$OUT/raw.tgz" "$OUT/summary.md"
exec > >(tee -a "$OUT/run.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export DRY_RUN=${DRY_RUN:-0}
export COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PY=${PY:-python3}
TORCH_PY=${TORCH_PY:-python3}
if [ "$DRY_RUN" != 0 ]; then BUDGET_S=${BUDGET_S:-300}; else BUDGET_S=${BUDGET_S:-480}; fi
STAGES=${STAGES:-}
LIMITS=${LIMITS:-}  # e.g. "mla:120,peers:20": other stage limits than the defaults below
# (the dry run interprets the kernels on a shared 2-core CPU: more time for those stages)
[ "$DRY_RUN" != 0 ] && LIMITS=${LIMITS:-int4:130,mla:100,experts:70}
RESERVE=15
ORDER="ceilings:25 kernel_check:120 layers:120 eagle3:120 int4:150 k25_slice:160 mla:55 experts:40 peers:30"
DEFAULT="ceilings,int4,k25_slice,mla,experts,peers"
SCRATCH=$(mktemp -d -t moejax_gpu_check.XXXXXX)
RAN=""
selected() { if [ -z "$STAGES" ]; then [[ ",$DEFAULT," == *",$1,"* ]]; else [[ ",$STAGES," == *",$1,"* ]]; fi; }
later_limits() {  # the limits of the selected stages after $1
  local sum=0 after=0 entry
  for entry in $ORDER; do
    if [ "$after" = 1 ] && selected "${entry%%:*}"; then sum=$((sum + ${entry##*:})); fi
    [ "${entry%%:*}" = "$1" ] && after=1
  done
  echo $sum
}
rows_of() { grep -c "\"stage\": \"$1\"" "$OUT/results.jsonl" 2>/dev/null || true; }
pack_raw() {  # the raw dumps, at most 15 MiB compressed (a device call returns 16 MiB a file)
  tar -czf "$SCRATCH.tgz" -C "$SCRATCH" . 2>/dev/null
  if [ "$(stat -c %s "$SCRATCH.tgz" 2>/dev/null || echo 0)" -gt $((15 << 20)) ]; then
    tar -czf "$SCRATCH.tgz" -C "$SCRATCH" --exclude=int4_sass.txt . 2>/dev/null
  fi
  cp "$SCRATCH.tgz" "$OUT/raw.tgz"
}
stage() {  # stage NAME LIMIT COMMAND...
  local name=$1 limit=$2 entry; shift 2
  selected "$name" || return 0
  RAN="$RAN,$name"
  local left=$((BUDGET_S - RESERVE - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped, ${left}s of the budget left ==="
    $PY -m bench.protocol.rows "$OUT" "$name" "budget: ${left}s of BUDGET_S=$BUDGET_S left"
    return
  fi
  if [ -n "$STAGES" ]; then
    local spare=$((left - $(later_limits "$name")))
    [ "$spare" -gt "$limit" ] && limit=$spare
  fi
  for entry in ${LIMITS//,/ }; do [ "${entry%%:*}" = "$name" ] && limit=${entry##*:}; done
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name (limit ${limit}s, ${SECONDS}s into the run) ==="
  local t0=$SECONDS before rc
  before=$(rows_of "$name")
  if [ -n "${STAGE_STDOUT:-}" ]; then  # (the int4 stage's stdout: Mosaic GPU's SASS dumps)
    STAGE_LIMIT_S=$limit timeout -k 5 "$limit" "$@" > "$STAGE_STDOUT"
  else
    STAGE_LIMIT_S=$limit timeout -k 5 "$limit" "$@"
  fi
  rc=$?
  local rows=$(( $(rows_of "$name") - before ))
  [ -s "$OUT/results.jsonl" ] && [ -n "$(tail -c1 "$OUT/results.jsonl")" ] && echo >> "$OUT/results.jsonl"
  printf '{"stage": "%s", "impl": "stage_end", "case": "", "rc": %d, "seconds": %d, "limit_s": %d, "rows": %d, "commit": "%s", "dry_run": %s}\n' \
    "$name" "$rc" $((SECONDS - t0)) "$limit" "$rows" "$COMMIT" \
    "$([ "$DRY_RUN" != 0 ] && echo true || echo false)" >> "$OUT/results.jsonl"
  echo "=== $name: exit $rc after $((SECONDS - t0))s, $rows rows ==="
  pack_raw
}
{ nvidia-smi -q 2>&1 | head -300; } > "$SCRATCH/nvidia_smi.txt"
{ $PY -m pip list 2>&1; echo; $TORCH_PY -m pip list 2>&1; } > "$SCRATCH/pip_list.txt"
{ env | grep -E '^(XLA|JAX|CUDA|NVIDIA|TF_|MOSAIC)' ; } > "$SCRATCH/env.txt" 2>&1
echo "gpu_check: OUT=$OUT DRY_RUN=$DRY_RUN BUDGET_S=$BUDGET_S COMMIT=$COMMIT STAGES=${STAGES:-default}"

stage ceilings 25 $PY -m bench.protocol.ceilings "$OUT"
stage kernel_check 120 $PY -m bench.kernel_check --results="$OUT" --out="$SCRATCH/kernel_check.json"
if [ "$DRY_RUN" != 0 ]; then
  stage layers 120 $PY -m bench.protocol.layers "$OUT" --layers=3
  stage eagle3 120 $PY -m bench.protocol.eagle3 "$OUT" --layers=3
  stage int4 150 $PY -m bench.protocol.int4 "$OUT"
  stage k25_slice 160 $PY -m bench.protocol.k25_slice "$OUT" --layers=3
else
  # (XLA's GEMM autotuning off, as for the slice below: compiles stay short; in every row)
  stage layers 120 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    $PY -m bench.protocol.layers "$OUT" --layers=8
  stage eagle3 120 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    $PY -m bench.protocol.eagle3 "$OUT" --layers=3
  STAGE_STDOUT="$SCRATCH/int4_sass.txt" stage int4 150 env MOSAIC_GPU_DUMP_SASS=1 \
    MOSAIC_GPU_DUMP_PTXAS=1 SASS_LOG="$SCRATCH/int4_sass.txt" $PY -m bench.protocol.int4 "$OUT"
  # (XLA's GEMM autotuning off, as in the second GPU run: the slice's compiles stay short)
  stage k25_slice 160 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    $PY -m bench.protocol.k25_slice "$OUT" --layers=4
fi
stage mla 55 $PY -m bench.protocol.mla "$OUT"
stage experts 40 $PY -m bench.protocol.experts "$OUT" --formats=fp8,bf16
stage peers 30 $TORCH_PY -m bench.protocol.peers "$OUT"

$PY -m bench.summarize "$OUT" > "$OUT/summary.md" 2>&1
pack_raw
rm -rf "$SCRATCH" "$SCRATCH.tgz"
echo
cat "$OUT/summary.md"
$PY -m bench.protocol.rows check "$OUT" "${RAN#,}"
status=$?
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null  # run.log complete before the call returns
exit $status
