#!/bin/sh
# The panel kernel alone (panel_calls.c), at the source as committed ("base") and with Q4_K's
# sub-block loop unrolled for calls of up to 8 rows (q4k_unroll.patch, "unrolled"), in L2 and
# streamed from memory (2026-12-06, AMD EPYC Zen 5, family 26 model 2, 2 cores).
# sh results_final/zen5_1206b/panel_calls.sh > results_final/zen5_1206b/panel_calls.txt
D=$(cd "$(dirname "$0")" && pwd)
T=$(mktemp -d)
cp -r "$D/../../specserve/kernels/csrc" "$T/base"
cp -r "$T/base" "$T/unrolled" && (cd "$T/unrolled" && patch -s -p1 < "$D/q4k_unroll.patch")
CF="-O3 -march=native -fopenmp -std=gnu11 -ffp-contract=off -fno-math-errno"
for where in "16 1" "8192 2"; do
  set -- $where
  for v in base unrolled; do
    for r in 1 2 4 8 12; do
      gcc $CF -DNPAN=$1 -DNT=$2 -DRR=$r -I"$T/$v" -o "$T/pc" "$D/panel_calls.c" -lm && printf "%-9s" $v && "$T/pc"
    done
  done
done
for r in 8 12; do
  for e in 0 1; do
    gcc -O3 -march=native -DR=$r -DEMB=$e -DUNPACK=1 -o "$T/bc" "$D/bcast.c" && "$T/bc"
  done
done
rm -rf "$T"
# The whole forward was compared once, from a tree with the patch applied (QP_UNROLL_ROWS=0 is the
# base loop): python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b,gemma3-270m --formats auto
#   --rows 1,2,4,8 --context 512 --min-time 2 --variants "new=;old=-DQP_UNROLL_ROWS=0"
# (its table is at the end of panel_calls.txt)
