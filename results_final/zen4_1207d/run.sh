#!/bin/sh
# Qwen3.5-35B-A3B's shapes (random weights, the first 4 of its 40 layers) against native llama.cpp,
# and where our decode step goes. AMD EPYC Zen 4 (family 25 model 17), 2 cores, 2026-12-07.
set -e
cd "$(dirname "$0")/../.."
python benchmarks/hybrid_speed.py --model 35b-a3b --layers 4 --types q4_k_m --prefill 2048 --decode 32 \
  --widths 1-9 --out results_final/zen4_1207d/hybrid_moe.json --markdown results_final/zen4_1207d/hybrid_moe.md
python results_final/zen4_1207d/moe_split.py > results_final/zen4_1207d/moe_split.txt
