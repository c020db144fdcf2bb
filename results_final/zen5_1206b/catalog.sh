#!/bin/sh
# 2026-12-06 (second session), AMD EPYC Zen 5 (family 26 model 2), 2 cores: every catalog model against
# native llama-server at commit 7c1238d (the prefetch-hint trial in every server), the configurations of
# results_final/zen5_1206/run.sh, one server at a time. sh results_final/zen5_1206b/catalog.sh
D=results_final/zen5_1206b
run() {  # model label configs
  python benchmarks/native_llamacpp.py --model "$1" --tokens 128 --rounds 2 --limit 2 --configs "$3" \
    --out $D/catalog_$2.json --markdown $D/catalog_$2.md
}
run smollm2-135m smollm2 "llama.cpp plain,specserve plain,specserve ngram,specserve suffix"
run gemma3-270m gemma3 "llama.cpp plain,specserve plain,specserve suffix"
run qwen2.5-coder-0.5b qwen0.5b "llama.cpp plain,specserve plain,specserve suffix"
