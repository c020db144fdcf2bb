#!/bin/bash
# the chain alone on code and edit, three runs, at a31f148 (before the prior): how many steps drafted
# (rows' "spec" in repro_N.json; run 1's first prompt, code-lru: 7 steps, 8 drafts in 64 tokens)
DRAFT='{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5, "quantization": "q4_0", "draft_vocab_size": 32768}'
CHAIN='{"method": "chain", "num_speculative_tokens": 8, "drafters": [{"method": "suffix", "num_speculative_tokens": 8}, '"$DRAFT"']}'
for r in 1 2 3; do
  python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b --spec "chain=$CHAIN" --suites code,edit --tokens 64 \
    --runs 1 --prompts-per-suite 2 --out repro_$r.json > repro_$r.log 2>&1
done
