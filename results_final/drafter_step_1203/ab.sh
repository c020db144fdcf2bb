#!/bin/sh
# Drafter proposal cost before (5e9d33d: the drafters' own torch layers) and after (the family's
# layer modules), alternating two checkouts: OLD=/path/to/5e9d33d NEW=/path/to/this commit.
set -e
for r in 1 2; do
  for t in old new; do
    tree=$([ $t = old ] && echo "$OLD" || echo "$NEW")
    PYTHONPATH=$tree python "$tree/benchmarks/drafter_step.py" --tokens 64 --prompts 3 --out step_wk_${t}_$r.json
  done
done
for r in 1 2; do
  for t in old new; do
    tree=$([ $t = old ] && echo "$OLD" || echo "$NEW")
    PYTHONPATH=$tree python "$tree/benchmarks/drafter_step.py" --model qwen2.5-coder-1.5b --methods mtp --tokens 32 \
      --prompts 2 --out stepq_wk_${t}_$r.json
  done
done
PYTHONPATH=$NEW python "$NEW/benchmarks/drafter_step.py" --model qwen2.5-coder-1.5b --methods mtp \
  --mtp-draft-vocab 32768 --tokens 32 --prompts 2 --out qwen_vocab.json
