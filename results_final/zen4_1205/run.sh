#!/bin/sh
# 2026-12-05, AMD EPYC Zen 4 (family 25 model 17), 2 cores: every catalog model against native
# llama-server in one session, plain and the best speculation of each, one server at a time
D=results_final/zen4_1205
run() {  # model label configs
  python benchmarks/native_llamacpp.py --model "$1" --tokens 128 --rounds 2 --limit 2 --configs "$3" \
    --out $D/native_$2.json --markdown $D/native_$2.md
}
run smollm2-135m smollm2 "llama.cpp plain,llama.cpp ngram-mod,specserve plain,specserve ngram,specserve suffix"
run gemma3-270m gemma3 "llama.cpp plain,specserve plain,specserve suffix"
run qwen2.5-coder-0.5b qwen0.5b "llama.cpp plain,specserve plain,specserve suffix"
run qwen2.5-coder-1.5b qwen1.5b \
  "llama.cpp plain,specserve plain,specserve draft q4_0 32K,specserve suffix then draft q4_0 32K"
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 2 \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K" \
  --out $D/native_qwen1.5b_run2.json --markdown $D/native_qwen1.5b_run2.md  # a second run, an hour later
