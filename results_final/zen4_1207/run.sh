#!/bin/sh
# 2026-12-07 (fifth session), AMD EPYC Zen 4 (family 25 model 17), 2 cores: a seeded request's
# position noise from counter-based uniforms (kernels/noise.py) instead of torch's generator,
# measured as results_final/zen5_1207d measured the generator's: plain and ngram, in one process.
# sh results_final/zen4_1207/run.sh
D=results_final/zen4_1207
python results_final/zen5_1207d/seeded_cost.py smollm2-135m 6 > $D/seeded_cost_smollm2.txt
python results_final/zen5_1207d/seeded_cost.py qwen2.5-coder-1.5b 3 > $D/seeded_cost_qwen1.5b.txt
python $D/noise_time.py > $D/noise_time.txt
