#!/bin/bash
# 2026-12-06, AMD EPYC Zen 4 (family 25 model 17), 2 cores: the adaptive policy before (OLD tree,
# d4f0373) and after a sequence drafting nothing drifts back up to its own slow acceptance estimate;
# qwen2.5-coder-1.5b with the 4-bit 32K-vocabulary 0.5b draft (k <= 8, as the native comparison
# serves it), three rounds alternating, each against plain decode in its own process.
# OLD=dir NEW=dir: the two checkouts (git worktree add /tmp/base d4f0373).
OUT=$(cd "$(dirname "$0")" && pwd)
DRAFT='{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 8, "quantization": "q4_0", "draft_vocab_size": 32768}'
for round in 1 2 3; do
  for tree in old new; do
    dir=${OLD:-/tmp/base}; [ $tree = new ] && dir=${NEW:-.}
    (cd $dir && PYTHONPATH=$PWD python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b --spec "draft=$DRAFT" \
      --suites code,math,prose,edit --tokens 128 --runs 1 --prompts-per-suite 4 \
      --markdown $OUT/${tree}_r$round.md --out $OUT/${tree}_r$round.json > $OUT/${tree}_r$round.log 2>&1)
  done
done
