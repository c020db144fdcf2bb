#!/bin/sh
# 2026-12-04 evening, AMD EPYC Zen 4 (family 25), 2 cores: the verification width t(M)/t(1) of every
# catalog model, the same command run several times over the session (the machine is shared)
for i in 1 2 3 4 5 6; do
  python benchmarks/decode_cost.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
    --formats auto --rows 1,8,9 --context 512 --min-time 1.5 \
    --markdown results_final/zen4_1204b/decode_cost_$i.md --out results_final/zen4_1204b/decode_cost_$i.json
done
python benchmarks/width_runs.py results_final/zen4_1204b/decode_cost_*.json --markdown results_final/zen4_1204b/width.md
python benchmarks/int_dot_peak.py --rows 1,8 --formats Q4_K,Q6_K --n 17920 --k 1536 --rounds 30 --markdown results_final/zen4_1204b/int_dot_peak_in_cache.md
python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b --spec 'draft q4_0 32K={"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5, "quantization": "q4_0", "draft_vocab_size": 32768}' --suites code,math,prose --prompts-per-suite 2 --runs 2 --tokens 96 --out results_final/zen4_1204b/spec_qwen1.5b.json --markdown results_final/zen4_1204b/spec_qwen1.5b.md
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 1 --configs "llama.cpp plain,llama.cpp plain THP,specserve plain,specserve draft q4_0 32K" --out results_final/zen4_1204b/native_qwen1.5b.json --markdown results_final/zen4_1204b/native_qwen1.5b.md
