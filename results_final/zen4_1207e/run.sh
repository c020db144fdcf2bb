#!/bin/sh
# Qwen3.5-35B-A3B's shapes (random weights, the first 4 of its 40 layers) against native llama.cpp,
# after the mixture-of-experts layer's torch ops were cut (moe_combine, one routing plan per layer,
# the shared expert in the routed experts' kernel calls). AMD EPYC Zen 4 (family 25 model 17), 2 cores,
# 2026-12-07. sh run.sh N writes hybrid_moe_runN.{json,md}; moe_ops_LABEL.txt is moe_ops.py's profile
# (LABEL before: the parent commit's hybrid.py and layers.py; after: this commit's).
set -e
cd "$(dirname "$0")/../.."
n=${1:-1}
python benchmarks/hybrid_speed.py --model 35b-a3b --layers 4 --types q4_k_m --prefill 2048 --decode 32 \
  --widths 1-9 --out results_final/zen4_1207e/hybrid_moe_run$n.json \
  --markdown results_final/zen4_1207e/hybrid_moe_run$n.md
