#!/bin/sh
# smollm2-135m's prefetch-hint trial in three decode_cost.py processes one after the other (the hint
# it picks and the median t0/t1 are under each table). sh results_final/zen5_1206b/smollm2_hint.sh
for i in 1 2 3; do
  python benchmarks/decode_cost.py --models smollm2-135m --formats auto --rows 1,8 --context 512 --min-time 1 2>/dev/null \
    | grep "prefetch hint"
done
