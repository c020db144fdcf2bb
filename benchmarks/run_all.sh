#!/usr/bin/env bash
# Every benchmark behind the README's tables, one after another (about 1.5 hours on 2 cores).
# Run on a quiet machine: `uptime` should show a load average below 1.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results}
mkdir -p "$out"
python benchmarks/decode_cost.py --out "$out/decode_cost.json" --markdown "$out/decode_cost.md"
python benchmarks/vs_llamacpp.py --model smollm2-135m --tokens 128 --runs 3 --prompts-per-suite 4 \
  --out "$out/vs_llamacpp_smollm2.json" --markdown "$out/vs_llamacpp_smollm2.md"
python benchmarks/vs_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --runs 2 --prompts-per-suite 2 \
  --out "$out/vs_llamacpp_qwen1.5b.json" --markdown "$out/vs_llamacpp_qwen1.5b.md"
python benchmarks/spec_decode.py --tokens 128 --runs 2 --prompts-per-suite 3 --adaptive both \
  --out "$out/spec_decode.json" --markdown "$out/spec_decode.md"
specserve bench --ab " --speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":8}'" " --model smollm2-135m" \
  --labels ngram,plain --suite code,math,prose --runs 3 --max-tokens 256 \
  --out "$out/bench_ab.json" --markdown "$out/bench_ab.md" --chart "$out/bench_ab.png"
