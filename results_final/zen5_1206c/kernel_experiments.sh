#!/bin/sh
# Q4_K panel-kernel experiments at verification width, not kept (2026-12-06, AMD EPYC Zen 5 family 26
# model 2, 2 cores): what bounds 8 rows. In L2 ("16 panels, 1 thread") and streamed from memory in huge
# pages ("8192 panels, 2 threads").
# sh results_final/zen5_1206c/kernel_experiments.sh > results_final/zen5_1206c/kernel_experiments.txt
D=$(cd "$(dirname "$0")" && pwd)
T=$(mktemp -d)
cp -r "$D/../../specserve/kernels/csrc" "$T/base"
cp -r "$T/base" "$T/ablate" && (cd "$T/ablate" && patch -s -p1 < "$D/q4k_ablation.patch")
CF="-O3 -march=native -fopenmp -std=gnu11 -ffp-contract=off -fno-math-errno"
echo "## 1. broadcasts: vpdpbusd chains, activation broadcast from memory (MODE 0), shuffled (1), none (2)"
for np in 1 2; do for r in 4 8; do for m in 0 1 2; do
  gcc -O3 -march=native -DMODE=$m -DNP=$np -DR=$r -o "$T/bc" "$D/bcast_np.c" && "$T/bc"
done; done; done
echo "## 2. the 8-row call without the mins term (NOMIN) and without the sub-block scales (NOSCALE): wrong results, time only"
for where in "16 1" "8192 2"; do
  set -- $where
  for d in "" "-DNOMIN" "-DNOSCALE" "-DNOMIN -DNOSCALE"; do
    gcc $CF $d -DKNP=1 -DNPAN=$1 -DNT=$2 -DRR=8 -I"$T/ablate" -I"$D" -o "$T/pc" "$D/../zen5_1206b/panel_calls.c" -lm &&
      printf "%-22s" "[$d]" && "$T/pc"
  done
done
echo "## 3. two panels per broadcast: pq_rows' pair pass (two streams), q4k_pair.h (two streams; one interleaved stream)"
for where in "16 1" "8192 2"; do
  set -- $where
  for r in 1 4 8; do
    gcc $CF -DKNP=1 -DNPAN=$1 -DNT=$2 -DRR=$r -I"$T/base" -I"$D" -o "$T/pc" "$D/../zen5_1206b/panel_calls.c" -lm &&
      printf "%-22s" "one panel" && "$T/pc"
    gcc $CF -DKNP=2 -DNPAN=$1 -DNT=$2 -DRR=$r -I"$T/base" -I"$D" -o "$T/pc" "$D/../zen5_1206b/panel_calls.c" -lm &&
      printf "%-22s" "pair pass" && "$T/pc"
    gcc $CF -DNEW=1 -DRG_=8 -DKNP=2 -DNPAN=$1 -DNT=$2 -DRR=$r -I"$T/base" -I"$D" -o "$T/pc" "$D/../zen5_1206b/panel_calls.c" -lm &&
      printf "%-22s" "q4k_pair" && "$T/pc"
    gcc $CF -DNEW=1 -DIL=1 -DRG_=8 -DKNP=2 -DNPAN=$1 -DNT=$2 -DRR=$r -I"$T/base" -I"$D" -o "$T/pc" "$D/../zen5_1206b/panel_calls.c" -lm &&
      printf "%-22s" "q4k_pair interleaved" && "$T/pc"
  done
done
rm -rf "$T"
