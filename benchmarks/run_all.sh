#!/usr/bin/env bash
# The benchmarks behind the README's tables, one after another (roughly two hours on 2 cores: the hybrid
# table about 30 minutes, the 32K needle and the soak 15 each).
# Run on a quiet machine: `uptime` should show a load average below 1. Sizes are kept small so
# the whole set fits in one sitting; raise --runs / --prompts-per-suite for tighter numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results}
mkdir -p "$out"
python benchmarks/vs_llamacpp.py --model smollm2-135m --tokens 128 --runs 2 --prompts-per-suite 2 \
  --out "$out/vs_llamacpp_smollm2.json" --markdown "$out/vs_llamacpp_smollm2.md"
# native llama-server (built once from the llama-cpp-python sdist: about 8 minutes on 2 cores)
python benchmarks/native_llamacpp.py --model smollm2-135m --tokens 128 --rounds 1 --limit 2 \
  --out "$out/native_smollm2.json" --markdown "$out/native_smollm2.md"
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 1 --limit 1 \
  --out "$out/native_qwen1.5b.json" --markdown "$out/native_qwen1.5b.md"
python benchmarks/native_llamacpp.py --model gemma3-270m --tokens 128 --rounds 1 --limit 2 \
  --out "$out/native_gemma3.json" --markdown "$out/native_gemma3.md"
python benchmarks/native_llamacpp.py --model qwen2.5-coder-0.5b --tokens 128 --rounds 1 --limit 2 \
  --out "$out/native_qwen0.5b.json" --markdown "$out/native_qwen0.5b.md"
# one forward (1 and 8 rows) against llama-bench's, fresh processes taking turns
python benchmarks/forward_vs_llamacpp.py --rounds 3 --out "$out/forward_vs_llamacpp.json" \
  --markdown "$out/forward_vs_llamacpp.md"
python benchmarks/structured.py --model smollm2-135m --drafters ngram,draft_model --every 2 \
  --out "$out/structured_smollm2.json"
python benchmarks/structured.py --model qwen2.5-coder-1.5b --drafters ngram \
  --out "$out/structured_qwen1.5b.json"
python benchmarks/spec_decode.py --models smollm2-135m --tokens 128 --runs 2 --prompts-per-suite 2 \
  --adaptive both --out "$out/spec_smollm2.json" --markdown "$out/spec_smollm2.md"
# the shipped dflash drafter's teacher-forced acceptance (set ANSWERS=DIR/data/answers.pt for the held-out rows)
python benchmarks/drafter_acceptance.py ${ANSWERS:+--answers "$ANSWERS"} --out "$out/drafter_acceptance.json"
python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b --tokens 128 --runs 2 --prompts-per-suite 2 \
  --adaptive both --out "$out/spec_qwen1.5b.json" --markdown "$out/spec_qwen1.5b.md"
python benchmarks/vs_llamacpp.py --model qwen2.5-coder-1.5b --tokens 64 --runs 1 --prompts-per-suite 1 \
  --ctx 1024 --out "$out/vs_llamacpp_qwen1.5b.json" --markdown "$out/vs_llamacpp_qwen1.5b.md"
specserve bench --ab " --speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":8}'" " --model smollm2-135m" \
  --labels ngram,plain --suite code,math,prose --limit 4 --runs 2 --max-tokens 128 \
  --out "$out/bench_ab.json" --markdown "$out/bench_ab.md" --chart "$out/bench_ab.png"
python benchmarks/decode_cost.py --models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --formats auto \
  --rows 1,2,4,8 --paths fused,python --min-time 1 --out "$out/decode_cost.json" --markdown "$out/decode_cost.md"
# verification width at a 512-token context, every catalog model, and where one forward's time goes
python benchmarks/decode_cost.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --formats auto --rows 1,2,4,8,16 --context 512 --min-time 1.5 --out "$out/decode_cost_512.json" \
  --markdown "$out/decode_cost_512.md"
# hybrid Qwen3.5 at its real shapes (random weights) vs native llama.cpp (about 30 minutes)
python benchmarks/hybrid_speed.py --out "$out/hybrid_speed.json" --markdown "$out/hybrid_speed.md"
# one-row linears' weight read rate vs a plain read, cache-resident vs streamed, per prefetch distance
python benchmarks/weight_stream.py --prefetch 0,2048,16384,65536 --rounds 20 --markdown "$out/weight_stream.md"
python benchmarks/host_pages.py --models smollm2-135m,qwen2.5-coder-1.5b --contexts 512 --rounds 30 --markdown "$out/host_pages.md"
python benchmarks/forward_breakdown.py --models smollm2-135m,qwen2.5-coder-1.5b --rows 1,8 --rounds 15 \
  --out "$out/forward_breakdown.json" --markdown "$out/forward_breakdown.md"
# the same forward over every KV cache dtype at a 2K-token context (fused vs per-op Python path)
python benchmarks/decode_cost.py --models smollm2-135m --formats auto --rows 1,8 --context 2048 \
  --kv-dtypes fp32,bf16,fp16,fp8_e4m3,int8,int4 --paths fused,python --min-time 1 \
  --out "$out/decode_cost_kv2048.json" --markdown "$out/decode_cost_kv2048.md"
# one kv head (attention shared by the threads) at an 8K-token context
python benchmarks/decode_cost.py --models gemma3-270m --formats auto --rows 1,4 --context 8192 \
  --kv-dtypes fp32,int8,int4 --out "$out/decode_cost_gemma8k.json" --markdown "$out/decode_cost_gemma8k.md"
python benchmarks/weight_quality.py --models smollm2-135m,qwen2.5-coder-1.5b --out "$out/weight_quality.json" \
  --markdown "$out/weight_quality.md"
python benchmarks/kv_dtypes.py --models smollm2-135m --out "$out/kv_dtypes.json" --markdown "$out/kv_dtypes.md"
specserve bench --ab " --speculative-config '{\"method\":\"ngram\",\"num_speculative_tokens\":8}'" " --model smollm2-135m" \
  --labels ngram,plain --scenario concurrency --concurrency 1,2,4,8 --requests-per-client 2 --max-tokens 96 \
  --suite code --out "$out/concurrency.json" --markdown "$out/concurrency.md"
# long prompts: a stream's inter-token latency while a 4K prompt arrives, with and without chunked prefill
python benchmarks/chunked_prefill.py --model smollm2-135m --prompt-tokens 4096 --chunks 256,512,8192 \
  --out "$out/chunked_prefill.json" --markdown "$out/chunked_prefill.md"
# a 4K-token shared prefix: cold vs warm time to first token (prefix cache)
specserve bench --serve " --model smollm2-135m" --scenario prefix --prefix-tokens 4096 --rounds 4 \
  --out "$out/prefix.json" --markdown "$out/prefix.md"
# the needle at 90% of the maximum context: smollm2 on every KV dtype, qwen2.5-coder-0.5b at 32K (about 15 minutes)
bash benchmarks/needle_kv.sh "$out" smollm2-135m 8192 "fp32 bf16 fp16 fp8_e4m3 int8 int4"
# (SKIP_32K=1 leaves the 32K run out)
[ -n "${SKIP_32K:-}" ] || bash benchmarks/needle_kv.sh "$out" qwen2.5-coder-0.5b 32768 fp32
python benchmarks/needle_table.py "$out"/needle_smollm2-135m_{fp32,bf16,fp16,fp8_e4m3,int8,int4}.json \
  $(ls "$out/needle_qwen2.5-coder-0.5b_fp32.json" 2>/dev/null) > "$out/needle.md"
# why serve steps the engine in the main thread
python benchmarks/engine_thread.py --model smollm2-135m > "$out/engine_thread.md"
# running streams' inter-token latency while 4K and 8K prompts arrive: fixed chunks vs the step budget
python benchmarks/prefill_stall.py --out "$out/prefill_stall.json" --markdown "$out/prefill_stall.md"
# images: time to first token, one and five 448x448 images, plain and MTP (tiny and Qwen3.5-0.8B shapes)
python benchmarks/vision_ttft.py --out "$out/vision_ttft.json" --markdown "$out/vision_ttft.md"
python benchmarks/vision_stall.py --out "$out/vision_stall.json" --markdown "$out/vision_stall.md"
# tensor parallel: TP=1 with every core vs -tp 2 with a core per rank, and TP=2's agreement with TP=1
python benchmarks/tensor_parallel.py > "$out/tensor_parallel.md"
# the 15-minute soak (not a table: it passes or fails)
python benchmarks/soak.py --minutes 15 --out "$out/soak.json"
