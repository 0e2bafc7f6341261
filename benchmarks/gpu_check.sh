#!/usr/bin/env bash
# The device check for a lent GPU: one call of at most ~9 minutes (TOTAL_S), every step under its
# own time limit, every output under $OUT (the run's log is $OUT/log).
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh               # on the GPU machine, repository root
#   TOTAL_S=600 OUT=/tmp/gpu bash benchmarks/gpu_check.sh   # a longer call
#
# In order (the 2026-11-27 checks verified the INT traced codecs on CUDA, the offload gpu tests,
# the kernel tests and the gpu suite's table, benchmarks/results/gpu_check.md; the third found a
# graph leak in the router and launch-bound INT kernels, both fixed since; this check goes to
# what is still open):
#  b3. offload under compile=True (src/slimact/bench/offload_check.py): llama-1b bf16 4 x 2048,
#     eager none, compiled-auto without and with offload from one profile: activation peaks, step
#     ratio, time not hidden, min gradient cosine, host bytes, link bandwidth, the longest
#     sequence at batch 1 beside compile-block@0 and torch's checkpoint, the allocator's memory
#     after each stage; table and JSON in the log;
#  k. the Triton INT kernels on CUDA against their refs (tests/test_quant.py and
#     tests/test_stochastic_rounding.py, -k triton), tiles of many groups across programs, and
#     the codecs' fused deferred encodes (atomics, the column kernel's ticket) and one-launch
#     decodes against their refs on CUDA (tests/test_quant_stats.py -m gpu); then
#     the offload gpu tests (strategy offload now installs through the plan runtime); then a
#     spec with eager parts under compile=True as one CompiledPlan (tests/test_compiled_presets.py);
#  c. slimact bench gpu with what is left less step a's share (its own time budget set to fit,
#     see src/slimact/bench/suites.py): the peak-first table in $OUT/bench/gpu.summary.md,
#     rewritten after every point, and every figure in $OUT/bench/gpu.json;
#  a. if LAYOUT_S (default 0) seconds are held back for it: the gpu-marked tests of
#     tests/test_compiled_layout.py that compare stochastic rounding and traced PRAC on CUDA
#     with CPU on the same weights and batch (still refused on CUDA; about 150 s).
#  p. (after b3, PROFILE_S seconds, 0 skips it) the step profile of eager int4 with the codecs'
#     statistics run op by op on CUDA against compiled by inductor (compiled-refs:int4, an A/B
#     switch until measured; src/slimact/ops/compiled_ref.py), llama-350m bf16 8 x 1024:
#     per step ms, kernels, launches, aten ops, syncs (src/slimact/bench/profile.py).
# A step that fails or times out does not stop the next one.
# At most 8 files come back from a lent machine's $OUT: log, layout.xml, gpu.profile.json,
# bench.log, bench/gpu.json, bench/gpu.summary.md.
set -u
OUT=${OUT:-/tmp/gpu_check}
TOTAL_S=${TOTAL_S:-540}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
export SLIMACT_TRACED_CODECS_ON_CUDA=1 # run the lossy traced codecs (refused on CUDA otherwise) to check them
py=${PYTHON:-python3}
start=$(date +%s)
left() { echo $((TOTAL_S - ($(date +%s) - start))); }
log() { echo "== $* ($(($(date +%s) - start)) s in)" | tee -a "$OUT/log"; }

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  git log --oneline -1 2>/dev/null
} 2>&1 | tee -a "$OUT/log"

# b3: offload under compile=True against the same compiled-auto without offload and eager none
# (src/slimact/bench/offload_check.py); no file of its own ($OUT brings back 8): its table and
# its JSON (one line) go to $OUT/log
log "b3. offload under compile=True: llama-1b bf16 4 x 2048 (none, compiled-auto without and with offload, longest seq at batch 1)"
timeout "${OFFCOMPILE_S:-170}" $py -m slimact.bench.offload_check --model llama-1b --batch 4 \
  --seq 2048 --dtype bfloat16 --device cuda --budget 10% --offload-budget 2% \
  --host-budget 64GiB --budgets 1/0 --codecs none/int8 --rounds 3 --seq-start 4096 \
  --seq-cap 65536 --point-limit-s 20 --json - 2>&1 \
  | grep -v -i warn | tail -40 | tee -a "$OUT/log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"

profile_s=${PROFILE_S:-100}
if [ "$profile_s" -gt 30 ]; then
  log "p. step profile of eager int4, op by op and compiled on CUDA, ${profile_s} s"
  timeout "$profile_s" $py -m slimact bench gpu --out-dir "$OUT" --time-budget $((profile_s - 15)) \
    --profile int4,compiled-refs:int4 2>&1 |
    grep -v '^USDT' | tee -a "$OUT/log"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"
fi

log "k. the Triton INT kernels against their refs; the offload gpu tests"
timeout "${KERNEL_S:-50}" $py -m pytest -q -p no:cacheprovider tests/test_quant.py \
  tests/test_stochastic_rounding.py -k triton 2>&1 | tail -8 | tee -a "$OUT/log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"
SLIMACT_FUSED_CODECS=1 timeout "${FUSED_S:-60}" $py -m pytest -q -p no:cacheprovider -m gpu tests/test_quant_stats.py \
  2>&1 | tail -8 | tee -a "$OUT/log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"
timeout "${OFFLOAD_S:-60}" $py -m pytest -q -p no:cacheprovider -m gpu tests/test_offload.py \
  tests/test_compiled_offload.py tests/test_codecs.py -k offload 2>&1 | tail -8 | tee -a "$OUT/log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"
timeout "${PLAN_S:-60}" $py -m pytest -q -p no:cacheprovider -m gpu tests/test_compiled_presets.py \
  2>&1 | tail -8 | tee -a "$OUT/log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"

# what is left of the call, less step a's share and a margin for the process to start and
# write its last files
layout_s=${LAYOUT_S:-0}
bench_s=$(($(left) - layout_s - 15))
log "c. slimact bench gpu, ${bench_s} s"
if [ "$bench_s" -gt 60 ]; then
  timeout "$bench_s" $py -m slimact bench gpu --out-dir "$OUT/bench" --no-report \
    --time-budget $((bench_s - 30)) >"$OUT/bench.log" 2>&1
  echo "exit $?" | tee -a "$OUT/log"
  cat "$OUT/bench/gpu.summary.md" 2>/dev/null | tee -a "$OUT/log"
else
  echo "skipped: $bench_s s left" | tee -a "$OUT/log"
fi

layout_s=$(($(left) - 5))
if [ "${LAYOUT_S:-0}" -gt 0 ] && [ "$layout_s" -gt 60 ]; then
  log "a. gpu tests of tests/test_compiled_layout.py, ${layout_s} s"
  timeout "$layout_s" $py -m pytest -q -p no:cacheprovider -m gpu tests/test_compiled_layout.py \
    -k "noisy or int8-qk" --junitxml="$OUT/layout.xml" 2>&1 | tail -25 | tee -a "$OUT/log"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"
fi
log "done"
