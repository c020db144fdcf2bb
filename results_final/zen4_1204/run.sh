#!/bin/sh
# 2026-12-04, AMD EPYC Zen 4 (family 25), 2 cores: the commands behind results_final/zen4_1204/.
set -e
OUT=${OUT:-results_final/zen4_1204}
# the AVX2 build (what a Zen 3 runs) with int16 accumulation of the 4/6-bit dot products against the
# per-chunk dot products (-DQL_NO_I16ACC), interleaved in one process
SPECSERVE_KERNEL_VARIANT=avx2 python benchmarks/decode_cost.py --models smollm2-135m,qwen2.5-coder-1.5b \
  --formats auto --rows 1,8 --context 512 --min-time 2 --variants "i16=;per_chunk=-DQL_NO_I16ACC" \
  --markdown $OUT/avx2_i16.md --out $OUT/avx2_i16.json
SPECSERVE_KERNEL_VARIANT=avx2 python benchmarks/decode_cost.py --models gemma3-270m,qwen2.5-coder-0.5b \
  --formats auto --rows 1,8 --context 512 --min-time 2 --variants "i16=;per_chunk=-DQL_NO_I16ACC" \
  --markdown $OUT/avx2_i16_small.md --out $OUT/avx2_i16_small.json
# AVX-512 without VNNI (as on Skylake-SP): the same comparison, and the VNNI build beside them
SPECSERVE_KERNEL_VARIANT=native python benchmarks/decode_cost.py --models smollm2-135m,qwen2.5-coder-1.5b \
  --formats auto --rows 1,8 --context 512 --min-time 2 \
  --variants "i16=-mno-avx512vnni -mno-avxvnni;per_chunk=-mno-avx512vnni -mno-avxvnni -DQL_NO_I16ACC;vnni=" \
  --markdown $OUT/novnni_i16.md --out $OUT/novnni_i16.json
# this CPU's int8 peak and read speed, our linears' share of the peak, and each model's forwards against its floors
python benchmarks/int_dot_peak.py --rows 1,8,16 --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --rounds 20 --markdown $OUT/int_dot_peak.md --out $OUT/int_dot_peak.json
# the same right after (int_dot_peak_2.*)
python benchmarks/int_dot_peak.py --rows 1,8,16 --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --rounds 20 --markdown $OUT/int_dot_peak_2.md --out $OUT/int_dot_peak_2.json
# (int_dot_peak_early*.*: the same two commands at 9cc19fa, an hour earlier, before the script counted the K/V bytes
# and when it read memory with a C loop of its own instead of torch's sum)
# servers against native llama-server, with and without huge pages for llama.cpp
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 1 \
  --configs "llama.cpp plain,llama.cpp plain THP,specserve plain,specserve draft q4_0 32K" \
  --out $OUT/native_qwen1.5b_thp.json --markdown $OUT/native_qwen1.5b_thp.md
