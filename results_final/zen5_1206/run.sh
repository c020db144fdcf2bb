#!/bin/sh
# 2026-12-06, AMD EPYC Zen 5 (family 26 model 2), 2 cores: every catalog model against native
# llama-server in one session, plain and the best speculation of each, one server at a time
D=results_final/zen5_1206
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
# verification width on the same machine (t(M)/t(1), one process per model, row counts interleaved)
python benchmarks/decode_cost.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --formats auto --rows 1,2,4,8,16 --context 512 --min-time 1.5 --out $D/decode_cost.json --markdown $D/decode_cost.md
# the weight stream's software prefetch on this CPU: distance and hint (variants_prefetch.md), then t0 vs t1 alone
python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b,smollm2-135m --formats auto --rows 1,4,8 --context 512 \
  --min-time 1.5 --variants "base=;pf32k=-DQP_PF_BYTES=32768;pf0=-DQP_PF_BYTES=0;hint3=-DQP_PF_HINT=3" \
  --markdown $D/variants_prefetch.md
python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b --formats auto --rows 1,2,8 --context 512 \
  --min-time 3 --variants "base=;hint3=-DQP_PF_HINT=3" --markdown $D/variants_hint.md
