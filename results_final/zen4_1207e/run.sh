#!/bin/sh
# Qwen3.5-35B-A3B's shapes (random weights, the first 4 of its 40 layers) against native llama.cpp,
# after the mixture-of-experts layer's torch ops were cut (moe_combine, one routing plan per layer,
# the shared expert in the routed experts' kernel calls). AMD EPYC Zen 4 (family 25 model 17), 2 cores,
# 2026-12-07. sh run.sh N writes hybrid_moe_runN.{json,md} (run 1 at 38ce98d, runs 2 and 3 at 3fa54de);
# moe_ops_LABEL.txt is moe_ops.py's profile (before: e3964df's hybrid.py and layers.py; after: 38ce98d's).
set -e
cd "$(dirname "$0")/../.."
n=${1:-1}
python benchmarks/hybrid_speed.py --model 35b-a3b --layers 4 --types q4_k_m --prefill 2048 --decode 32 \
  --widths 1-9 --out results_final/zen4_1207e/hybrid_moe_run$n.json \
  --markdown results_final/zen4_1207e/hybrid_moe_run$n.md
# the rest of the section (each prints to its .txt; layer_cost.py needs hybrid_speed.py's 8-layer file too:
# --model 35b-a3b --layers 8 --types q4_k_m)
python results_final/zen4_1207e/moe_ops.py > results_final/zen4_1207e/moe_ops_after.txt
python results_final/zen4_1207e/moe_ab.py > results_final/zen4_1207e/moe_ab_run$n.txt
python results_final/zen4_1207e/step_parts.py > results_final/zen4_1207e/step_parts.txt
python results_final/zen4_1207e/linear_parts.py > results_final/zen4_1207e/linear_parts.txt
python results_final/zen4_1207e/layer_cost.py > results_final/zen4_1207e/layer_cost_run$n.txt
python results_final/zen4_1207e/deltanet_ab.py > results_final/zen4_1207e/deltanet_ab.txt
for i in 1 2; do python results_final/zen4_1207e/bimodal.py default; OMP_WAIT_POLICY=active python results_final/zen4_1207e/bimodal.py active; done > results_final/zen4_1207e/bimodal.txt
python results_final/zen4_1207e/bandwidth_modes.py > results_final/zen4_1207e/bandwidth_modes.txt
python results_final/zen4_1207e/argmax_time.py > results_final/zen4_1207e/argmax_time.txt
