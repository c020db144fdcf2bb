#!/bin/bash
# chain [suffix, 4-bit 32K draft] vs that draft alone, before (old tree /tmp/cc2, d911758) and after
# (new tree /tmp/wk, c5c5d25) the chain's acceptance-aware fall-through; two rounds alternating.
# OLD=dir NEW=dir run it on other checkouts (results_final/chain_rate_1203, prior_1203)
OUT=$1; mkdir -p $OUT
DRAFT='{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5, "quantization": "q4_0", "draft_vocab_size": 32768}'
CHAIN='{"method": "chain", "num_speculative_tokens": 8, "drafters": [{"method": "suffix", "num_speculative_tokens": 8}, '"$DRAFT"']}'
for round in 1 2; do
  for tree in old new; do
    dir=${OLD:-/tmp/cc2}; [ $tree = new ] && dir=${NEW:-/tmp/wk}
    cd $dir
    PYTHONPATH=$dir python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b --spec "draft 0.5b q4_0 32K=$DRAFT" --spec "chain suffix+draft=$CHAIN" --suites code,math,prose,edit --tokens 64 --runs 1 --prompts-per-suite 2 --markdown $OUT/chain_${tree}_r$round.md --out $OUT/chain_${tree}_r$round.json > $OUT/chain_${tree}_r$round.log 2>&1
  done
done
echo done > $OUT/DONE
