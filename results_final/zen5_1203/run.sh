#!/bin/sh
# 2026-12-03, AMD EPYC Zen 5 (family 26; AVX-512 full width, VNNI), 2 cores: the commands behind
# README "One weight stream per thread". Run from the repository root, one at a time.
D=results_final/zen5_1203
# one panel at a time (one weight stream per thread) vs pairs a panel apart, same process
python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b --formats auto --rows 1,2,4,8,16 \
  --context 256 --min-time 2 --variants "pairs=-DQP_SINGLE_ROWS=0;single=" --markdown $D/variants_decode.md
python benchmarks/weight_stream.py --variants "pairs=-DQP_SINGLE_ROWS=0;single=" --rounds 12 --markdown $D/variants_stream.md
# verification width on every catalog model
python benchmarks/decode_cost.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --formats auto --rows 1,2,4,8,16 --context 512 --min-time 1.5 --markdown $D/decode_cost.md
# against native llama-server (rebuilt for this CPU)
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 1 \
  --configs "llama.cpp plain,llama.cpp draft-simple,specserve plain,specserve draft q4_0 32K,specserve suffix then draft q4_0 32K" \
  --out $D/native_qwen1.5b.json --markdown $D/native_qwen1.5b.md
for m in smollm2-135m gemma3-270m qwen2.5-coder-0.5b; do
  python benchmarks/native_llamacpp.py --model $m --tokens 128 --rounds 2 --limit 1 \
    --configs "llama.cpp plain,specserve plain" --out $D/native_$m.json --markdown $D/native_$m.md
done
# the same A/B with the AVX2 build (what a Zen 3 runs)
SPECSERVE_KERNEL_VARIANT=avx2 python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b --formats auto --rows 1,4,8 \
  --context 256 --min-time 2 --variants "pairs=-DQP_SINGLE_ROWS=0;single=" --markdown $D/variants_decode_avx2.md
# smollm2-135m's speculation
python benchmarks/native_llamacpp.py --model smollm2-135m --tokens 128 --rounds 2 --limit 1 \
  --configs "llama.cpp plain,llama.cpp ngram-mod,specserve plain,specserve ngram,specserve suffix" \
  --out $D/native_smollm2_spec.json --markdown $D/native_smollm2_spec.md
# interleaved pairs (not kept): see interleave/ab.md
# smollm2-135m alone (variants_smollm2.md)
python benchmarks/decode_cost.py --models smollm2-135m --formats auto --rows 1,4,8 --context 512 --min-time 2 \
  --variants "pairs=-DQP_SINGLE_ROWS=0;single=;single to 4=-DQP_SINGLE_ROWS=4"
