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
# the MoE shapes (needs hybrid_speed.py's 4- and 8-layer 35b-a3b files): fused against the Python path in one
# process, four layers' cost in one process, against llama.cpp (zen4_1207e's script), hybrid_speed's table
python results_final/zen4_1208/fused_ab.py ~/.cache/specserve/bench/qwen35-35b-a3b-random-8l/qwen35-35b-a3b-random-8l-q4_k_m.gguf \
  > results_final/zen4_1208/fused_ab_moe8_run$n.txt
python results_final/zen4_1208/layer_cost_1p.py > results_final/zen4_1208/layer_cost_1p_run$n.txt
python results_final/zen4_1207e/layer_cost.py > results_final/zen4_1208/layer_cost_run$n.txt
python benchmarks/hybrid_speed.py --model 35b-a3b --layers 4 --types q4_k_m --prefill 2048 --decode 32 \
  --widths 1-9 --out results_final/zen4_1208/hybrid_moe_run$n.json --markdown results_final/zen4_1208/hybrid_moe_run$n.md
# once (outputs without a run number): the Python path's step by parts, the first fused A/B, a step outside
# its forward
# python results_final/zen4_1208/step_parts_08b.py > results_final/zen4_1208/step_parts_08b.txt
# python results_final/zen4_1208/fused_ab.py > results_final/zen4_1208/fused_ab.txt
# python results_final/zen4_1208/step_overhead.py > results_final/zen4_1208/step_overhead.txt
# (fused_ab_moe8.txt, layer_cost_1p.txt: the MoE A/B and four layers' cost while the experts still ran in
# Python between calls, at the commit before 4b14684; fused_ab_moe8_c.txt, layer_cost_1p_c.txt: after it)
# python results_final/zen4_1208/mtp_step.py > results_final/zen4_1208/mtp_step.txt
# python results_final/zen4_1208/deltanet_silu_ab.py > results_final/zen4_1208/deltanet_silu_ab.txt
