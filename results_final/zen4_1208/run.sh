#!/bin/sh
# Qwen3.5-0.8B's shapes (random weights, hybrid_speed.py's Q4_K_M file) after the hybrid layers went
# into one C call a forward (models/hybrid_fused.py). AMD EPYC Zen 4 (family 25 model 17), 2 cores,
# 2026-12-08. sh run.sh N writes hybrid_08b_runN.{json,md}; the rest print to their .txt.
set -e
cd "$(dirname "$0")/../.."
n=${1:-1}
python benchmarks/hybrid_speed.py --model 0.8b --types q4_k_m --prefill 2048 --decode 64 \
  --out results_final/zen4_1208/hybrid_08b_run$n.json --markdown results_final/zen4_1208/hybrid_08b_run$n.md
python results_final/zen4_1208/fused_ab.py > results_final/zen4_1208/fused_ab_run$n.txt
