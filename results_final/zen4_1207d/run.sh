#!/bin/sh
# Qwen3.5-35B-A3B's shapes (random weights, the first 4 of its 40 layers) against native llama.cpp,
# and where our decode step goes. AMD EPYC Zen 4 (family 25 model 17), 2 cores, 2026-12-07.
# sh run.sh N writes hybrid_moe_runN.{json,md} (run 1 at commit 3c4b8b3, before kernels/grouped.py;
# runs 2 and 3 with it).
set -e
cd "$(dirname "$0")/../.."
n=${1:-1}
python benchmarks/hybrid_speed.py --model 35b-a3b --layers 4 --types q4_k_m --prefill 2048 --decode 32 \
  --widths 1-9 --out results_final/zen4_1207d/hybrid_moe_run$n.json \
  --markdown results_final/zen4_1207d/hybrid_moe_run$n.md
python results_final/zen4_1207d/moe_split.py > results_final/zen4_1207d/moe_split.txt
python results_final/zen4_1207d/moe_pages.py > results_final/zen4_1207d/moe_pages.txt
python results_final/zen4_1207d/expert_stream.py > results_final/zen4_1207d/expert_stream.txt
python results_final/zen4_1207d/llama_cpp_agreement.py > results_final/zen4_1207d/llama_cpp_agreement.txt
