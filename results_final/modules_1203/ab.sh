#!/bin/bash
# before/after of the modules commit: old tree /tmp/cc (95c97f4), new tree /tmp/wk; alternating
set -x
OUT=$1
mkdir -p $OUT
for round in 1 2; do
  for tree in old new; do
    dir=/tmp/cc; [ $tree = new ] && dir=/tmp/wk
    cd $dir
    PYTHONPATH=$dir python benchmarks/decode_cost.py --models smollm2-135m,qwen2.5-coder-0.5b --formats auto --rows 1,8 --context 512 --paths fused,python --min-time 1 --markdown $OUT/decode_cost_${tree}_r$round.md --out $OUT/decode_cost_${tree}_r$round.json > $OUT/decode_cost_${tree}_r$round.log 2>&1
    PYTHONPATH=$dir python benchmarks/spec_decode.py --models smollm2-135m --drafters ngram --tokens 64 --runs 1 --prompts-per-suite 2 --markdown $OUT/spec_decode_${tree}_r$round.md --out $OUT/spec_decode_${tree}_r$round.json > $OUT/spec_decode_${tree}_r$round.log 2>&1
  done
done
echo done > $OUT/DONE
