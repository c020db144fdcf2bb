#!/usr/bin/env bash
# The benchmarks behind the README's tables, one after another (about 10 minutes on 2 cores, plus the kv-dtype table).
# Run on a quiet machine: `uptime` should show a load average below 1. Sizes are kept small so
# the whole set fits in one sitting; raise --runs / --prompts-per-suite for tighter numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results}
mkdir -p "$out"
python benchmarks/vs_llamacpp.py --model smollm2-135m --tokens 128 --runs 2 --prompts-per-suite 2 \
  --out "$out/vs_llamacpp_smollm2.json" --markdown "$out/vs_llamacpp_smollm2.md"
python benchmarks/spec_decode.py --models smollm2-135m --tokens 128 --runs 2 --prompts-per-suite 2 \
  --adaptive both --out "$out/spec_smollm2.json" --markdown "$out/spec_smollm2.md"
python benchmarks/vs_llamacpp.py --model qwen2.5-coder-1.5b --tokens 64 --runs 1 --prompts-per-suite 1 \
  --ctx 1024 --out "$out/vs_llamacpp_qwen1.5b.json" --markdown "$out/vs_llamacpp_qwen1.5b.md"
specserve bench --ab " --speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":8}'" " --model smollm2-135m" \
  --labels ngram,plain --suite code,math,prose --limit 4 --runs 2 --max-tokens 128 \
  --out "$out/bench_ab.json" --markdown "$out/bench_ab.md" --chart "$out/bench_ab.png"
python benchmarks/decode_cost.py --models smollm2-135m --out "$out/decode_cost.json" --markdown "$out/decode_cost.md"
python benchmarks/kv_dtypes.py --models smollm2-135m --out "$out/kv_dtypes.json" --markdown "$out/kv_dtypes.md"
specserve bench --ab " --speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":8}'" " --model smollm2-135m" \
  --labels ngram,plain --scenario concurrency --concurrency 1,2,4,8 --requests-per-client 2 --max-tokens 96 \
  --suite code --out "$out/concurrency.json" --markdown "$out/concurrency.md"
