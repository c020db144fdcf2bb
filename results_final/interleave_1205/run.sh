#!/bin/sh
# 2026-12-05, AMD EPYC Zen 4 (family 25 model 17), 2 cores: every catalog model against native
# llama-server with all servers up at once and asked in turn prompt by prompt (--interleave), 4 prompts
# per suite, one round (each prompt new to every server)
D=results_final/interleave_1205
run() {  # model label configs
  python benchmarks/native_llamacpp.py --model "$1" --tokens 128 --rounds 1 --limit 4 --interleave --configs "$3" \
    --out $D/native_$2.json --markdown $D/native_$2.md
}
run qwen2.5-coder-1.5b qwen1.5b "llama.cpp plain,specserve plain,specserve draft q4_0 32K"
run smollm2-135m smollm2 "llama.cpp plain,llama.cpp ngram-mod,specserve plain,specserve suffix"
run gemma3-270m gemma3 "llama.cpp plain,specserve plain,specserve suffix"
run qwen2.5-coder-0.5b qwen0.5b "llama.cpp plain,specserve plain,specserve suffix"
run qwen2.5-coder-1.5b qwen1.5b_run2 "llama.cpp plain,specserve plain,specserve draft q4_0 32K,specserve suffix then draft q4_0 32K"
