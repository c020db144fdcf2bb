#!/bin/sh
# 2026-12-07 (fourth session), AMD EPYC Zen 5 (family 26 model 2), 2 cores: what sampling a seeded
# request by its positions' noise costs, plain and with ngram speculation, in one process.
# sh results_final/zen5_1207d/run.sh
D=results_final/zen5_1207d
python $D/seeded_cost.py smollm2-135m 6 > $D/seeded_cost_smollm2.txt
python $D/seeded_cost.py qwen2.5-coder-1.5b 3 > $D/seeded_cost_qwen1.5b.txt
