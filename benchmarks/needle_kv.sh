#!/usr/bin/env bash
# The needle test at 90% of each model's maximum context, on each KV cache dtype.
#   bash benchmarks/needle_kv.sh OUT_DIR [MODEL MAX_CONTEXT DTYPES]
# e.g. bash benchmarks/needle_kv.sh results smollm2-135m 8192 "fp32 bf16 fp16 fp8_e4m3 int8 int4"
# One server per dtype (`specserve bench --serve`); the table: python benchmarks/needle_table.py OUT_DIR/needle_*.json
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results}
model=${2:-smollm2-135m}
ctx=${3:-8192}
dtypes=${4:-fp32 bf16 fp16 fp8_e4m3 int8 int4}
len=$((ctx * 9 / 10))
mkdir -p "$out"
for d in $dtypes; do
  specserve bench --serve " --model $model --max-model-len $ctx --max-num-seqs 1 --kv-cache-dtype $d" \
    --scenario needle --lengths "$len" --depth 0.5 --timeout 3600 --quiet \
    --out "$out/needle_${model}_${d}.json"
done
