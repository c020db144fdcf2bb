#!/bin/sh
# 2026-12-06, AMD EPYC Zen 4 (family 25 model 17), 2 cores: qwen2.5-coder-1.5b against native
# llama-server, all servers up and asked in turn (--interleave), 4 prompts per suite, one round; the
# 4-bit 32K draft with prompt lookup's guesses in its forwards (the default) and without
D=results_final/lookup_native_1206
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 1 --limit 4 --interleave \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K,specserve draft q4_0 32K no lookup" \
  --out $D/native_qwen1.5b.json --markdown $D/native_qwen1.5b.md
