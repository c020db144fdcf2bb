#!/bin/sh
# 2026-12-03, AMD EPYC Zen 5 (family 26; AVX-512 full width, VNNI), 2 cores: the commands behind README
# "Speculation against native llama-server, its draft model drafting". Run from the repository root.
D=results_final/zen5_1203b
# twice (run1, run2), one after the other
for run in run1 run2; do
  python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 2 \
    --configs "llama.cpp plain,llama.cpp draft-simple,specserve plain,specserve draft q4_0 32K,specserve suffix then draft q4_0 32K" \
    --out $D/native_qwen1.5b_$run.json --markdown $D/native_qwen1.5b_$run.md
done
# verification width on every catalog model, again (compare results_final/zen5_1203/decode_cost.md)
python benchmarks/decode_cost.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --formats auto --rows 1,2,4,8,16 --context 512 --min-time 1.5 --markdown $D/decode_cost.md
