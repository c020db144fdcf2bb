#!/bin/bash
# 2026-12-06, AMD EPYC Zen 4 (family 25 model 17), 2 cores: the 4-bit 32K-vocabulary 0.5b draft of
# qwen2.5-coder-1.5b without (draft_lookup_tokens 0) and with (3, the default) prompt lookup's
# guesses checked in the draft model's forwards; adaptive and at a fixed k = 4, in one process
# against plain decode.
OUT=$(cd "$(dirname "$0")" && pwd)
D='{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4, "quantization": "q4_0", "draft_vocab_size": 32768'
python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b --adaptive both \
  --spec "lookup 0=$D, \"draft_lookup_tokens\": 0}" --spec "lookup 3=$D, \"draft_lookup_tokens\": 3}" \
  --suites code,math,prose,edit --tokens 128 --runs 2 --prompts-per-suite 2 \
  --markdown $OUT/spec.md --out $OUT/spec.json > $OUT/spec.log 2>&1
# tried and not kept: a 1-token match as evidence, and 6 guesses at k <= 7 (fixed k, code / math / prose)
F="$D, \"adaptive\": false"
python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b --adaptive off --spec "min2=$F}" \
  --spec "min1=$F, \"prompt_lookup_min\": 1}" \
  --spec "min1x6=$F, \"prompt_lookup_min\": 1, \"draft_lookup_tokens\": 6, \"num_speculative_tokens\": 7}" \
  --suites code,math,prose --tokens 128 --runs 1 --prompts-per-suite 2 --markdown $OUT/tried.md > $OUT/tried.log 2>&1
