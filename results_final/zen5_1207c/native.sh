#!/bin/sh
# 2026-12-07 (third session), AMD EPYC Zen 5 (family 26 model 2), 2 cores: the speed issue's two
# speculation models against native llama-server with this session's code (the policy of 2026-12-07:
# draft window, cost probes, first steps' exploring, widths following the one-row time, the answers
# seen), one server at a time, the method of results_final/zen5_1206/run.sh. sh results_final/zen5_1207c/native.sh
D=results_final/zen5_1207c
run() {  # model label configs
  python benchmarks/native_llamacpp.py --model "$1" --tokens 128 --rounds 2 --limit 2 --configs "$3" \
    --out $D/native_$2.json --markdown $D/native_$2.md
}
run qwen2.5-coder-1.5b qwen1.5b "llama.cpp plain,specserve plain,specserve draft q4_0 32K"
run smollm2-135m smollm2 "llama.cpp plain,specserve plain,specserve ngram,specserve suffix"
