#!/bin/sh
# 2026-12-03 (evening), AMD EPYC Zen 4 (family 25), 2 cores: the commands behind results_final/zen4_1203b/.
set -e
OUT=${OUT:-results_final/zen4_1203b}
# packed weights in huge pages (as loaded) against the same bytes in 4 KiB pages, in one process
# (host_pages_before_gather.md: the same command at 7ab739f, before the small weights were gathered)
python benchmarks/host_pages.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --contexts 512 --rounds 30 --markdown $OUT/host_pages.md
# one forward against llama-bench's, fresh processes taking turns (after the huge pages; llama-bench in 4 KiB pages:
# this ran before the script ran it under the huge-page tunable by default, i.e. --llama-pages 4k today)
python benchmarks/forward_vs_llamacpp.py --rounds 3 --llama-pages 4k --out $OUT/forward_vs_llamacpp.json \
  --markdown $OUT/forward_vs_llamacpp.md
# servers against native llama-server (after the huge pages)
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 1 \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K" \
  --out $OUT/native_qwen1.5b.json --markdown $OUT/native_qwen1.5b.md
# the same, a second run (native_qwen1.5b_2.*)
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 1 \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K" \
  --out $OUT/native_qwen1.5b_2.json --markdown $OUT/native_qwen1.5b_2.md
# llama.cpp with huge pages too (its malloc'd weights advised MADV_HUGEPAGE by glibc's tunable): native_qwen1.5b_thp.*
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 1 \
  --configs "llama.cpp plain,llama.cpp plain THP,specserve plain,specserve draft q4_0 32K" \
  --out $OUT/native_qwen1.5b_thp.json --markdown $OUT/native_qwen1.5b_thp.md
# one forward against llama-bench's with its weights in huge pages too (the script's default since this run)
python benchmarks/forward_vs_llamacpp.py --rounds 3 --out $OUT/forward_vs_llamacpp_thp.json \
  --markdown $OUT/forward_vs_llamacpp_thp.md
