#!/usr/bin/env bash
# The device check for a lent GPU: one call of at most ~9 minutes (TOTAL_S), every step under its
# own time limit, every output under $OUT (the run's log is $OUT/log).
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh               # on the GPU machine, repository root
#   TOTAL_S=600 OUT=/tmp/gpu bash benchmarks/gpu_check.sh   # a longer call
#
# In order (the 2026-11-27 check verified the INT traced codecs on CUDA, the offload gpu tests and
# the gpu suite's table, BENCHMARKS.md §8; this check goes to what is still open):
#  a. the gpu-marked tests of tests/test_compiled_layout.py that compare stochastic rounding and
#     traced PRAC on CUDA with CPU on the same weights and batch (still refused on CUDA), and the
#     INT8 codec with q/k coded (where the layout bug showed) as a regression check;
#  b3. offload under compile=True (src/slimact/bench/offload_check.py): llama-1b bf16 4 x 2048,
#     eager none, compiled-auto without and with offload from one profile: activation peaks, step
#     ratio, time not hidden, min gradient cosine, host bytes, link bandwidth, the longest
#     sequence at batch 1 beside compile-block@0 and torch's checkpoint; table and JSON in the log;
#  p. slimact bench gpu --profile: a few warm eager steps of none, int4, invact, chunked-ce,
#     recompute, torch's checkpoint and int4 with the codecs' statistics compiled on CUDA
#     (compiled-refs:int4) under torch.profiler, on the gpu suite's llama-350m bf16 8 x 1024: per
#     step ms, kernels, launches, aten ops, device syncs and the top kernels / host ops, appended
#     to the log as markdown, every figure in $OUT/gpu.profile.json (src/slimact/bench/profile.py);
#  b2. the gpu-marked offload tests (tests/test_offload.py, tests/test_codecs.py -k offload,
#     tests/test_compiled_offload.py): bit-identical gradients, pinned buffers reused, the
#     stress tests whose copies start late on their streams;
#  c. slimact bench gpu with what is left less step d's share (its own time budget set to fit,
#     see src/slimact/bench/suites.py): the peak-first table in $OUT/bench/gpu.summary.md,
#     rewritten after every point, and every figure in $OUT/bench/gpu.json;
#  d. the kernel tests (Triton on CUDA; the compiled refs on CUDA against their eager refs) in the
#     KERNEL_S seconds held back for them, their tail in the log.
# A step that fails or times out does not stop the next one. At most 8 files come back from a
# lent machine's $OUT: log, layout.xml, gpu.profile.json, offload.xml, bench.log, bench/gpu.json,
# bench/gpu.summary.md.
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

log "a. gpu tests of tests/test_compiled_layout.py"
timeout "${LAYOUT_S:-90}" $py -m pytest -q -p no:cacheprovider -m gpu tests/test_compiled_layout.py \
  -k "noisy or int8-qk" --junitxml="$OUT/layout.xml" 2>&1 | tail -25 | tee -a "$OUT/log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"

# b3: offload under compile=True against the same compiled-auto without offload and eager none
# (src/slimact/bench/offload_check.py); no file of its own ($OUT brings back 8): its table and
# its JSON (one line) go to $OUT/log
log "b3. offload under compile=True: llama-1b bf16 4 x 2048 (none, compiled-auto without and with offload, longest seq at batch 1)"
timeout "${OFFCOMPILE_S:-150}" $py -m slimact.bench.offload_check --model llama-1b --batch 4 \
  --seq 2048 --dtype bfloat16 --device cuda --budget 10% --offload-budget 2% \
  --host-budget 64GiB --budgets 1/0 --codecs none/int8 --rounds 3 --seq-start 4096 \
  --seq-cap 65536 --point-limit-s 20 --json - 2>&1 \
  | grep -v -i warn | tail -40 | tee -a "$OUT/log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"

profile_s=${PROFILE_S:-110}
log "p. step profile of eager points, llama-350m bf16 8 x 1024, ${profile_s} s"
timeout "$profile_s" $py -m slimact bench gpu --out-dir "$OUT" --time-budget $((profile_s - 25)) \
  --profile int4,invact,chunked-ce,recompute,anchor:torch-checkpoint,compiled-refs:int4 2>&1 |
  grep -v '^USDT' | tee -a "$OUT/log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"

log "b2. gpu tests of the offload action"
timeout "${OFFLOAD_S:-45}" $py -m pytest -q -p no:cacheprovider -m gpu tests/test_offload.py \
  tests/test_compiled_offload.py tests/test_codecs.py -k offload --junitxml="$OUT/offload.xml" 2>&1 | tail -15 | tee -a "$OUT/log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"

# what is left of the call, less step d's share and a margin for the process to start and
# write its last files
kernel_s=${KERNEL_S:-60}
bench_s=$(($(left) - kernel_s - 15))
log "c. slimact bench gpu, ${bench_s} s"
if [ "$bench_s" -gt 60 ]; then
  timeout "$bench_s" $py -m slimact bench gpu --out-dir "$OUT/bench" --no-report \
    --time-budget $((bench_s - 30)) >"$OUT/bench.log" 2>&1
  echo "exit $?" | tee -a "$OUT/log"
  cat "$OUT/bench/gpu.summary.md" 2>/dev/null | tee -a "$OUT/log"
else
  echo "skipped: $bench_s s left" | tee -a "$OUT/log"
fi

kernel_s=$(($(left) - 5))
log "d. kernel tests, ${kernel_s} s"
if [ "$kernel_s" -gt 30 ]; then
  timeout "$kernel_s" $py -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/test_compiled_ref.py tests/test_quant.py tests/test_inv_act.py 2>&1 | tail -15 |
    tee -a "$OUT/log"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/log"
else
  echo "skipped: no time left" | tee -a "$OUT/log"
fi
log "done"
