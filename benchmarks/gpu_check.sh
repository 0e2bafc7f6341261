#!/usr/bin/env bash
# The device check: slimact's Triton kernels and strategies on a real CUDA GPU, in one short run.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh      # on a machine with a GPU, torch, triton
#   SKIP_TESTS=1 COMPILE=1 STRATEGIES="none int8" bash benchmarks/gpu_check.sh   # compiled blocks
#
# 1. the kernel tests (inverted activations, INT4/INT8 quantization, chunked cross-entropy, the
#    codecs' CUDA offload): on CUDA they run the Triton kernels for real against their *_ref
#    twins, where CI runs them through TRITON_INTERPRET on CPU;
# 2. `slimact memory` on CUDA, bf16: saved bytes (the meter), peak (the CUDA allocator), the
#    step-time ratio to `none` (interleaved rounds) and the gradient cosine, per strategy.
# Every step has its own time limit and a failure does not stop the next; the log and one JSON
# line per strategy go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
export SLIMACT_TRACED_CODECS_ON_CUDA=1  # run the lossy traced codecs (refused on CUDA otherwise) to check them
py=${PYTHON:-python3}
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
  [ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_S:-270}" $py -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/test_compiled_layout.py tests/test_inv_act.py tests/test_quant.py tests/test_chunked_ce.py \
    tests/test_codecs.py \
    --junitxml="$OUT/kernels.xml" 2>&1 | tail -40
  echo "pytest exit: ${PIPESTATUS[0]}"
} 2>&1 | tee "$OUT/log"
for s in ${STRATEGIES:-invact int4 recompute invact+recompute auto@25%}; do
  echo "== slimact memory --strategy $s" | tee -a "$OUT/log"
  timeout "${MEM_S:-60}" $py -m slimact memory --model "${MODEL:-llama-20m}" --strategy "$s" \
    --device cuda --dtype bfloat16 --batch "${BATCH:-16}" --seq "${SEQ:-512}" \
    --steps "${ROUNDS:-15}" ${COMPILE:+--compile} --json >>"$OUT/memory.jsonl" 2>>"$OUT/log"
  echo "exit $?" | tee -a "$OUT/log"
done
tail -c 3000 "$OUT/memory.jsonl"
