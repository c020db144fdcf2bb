#!/bin/sh
# 2026-12-03, AMD EPYC Zen 4 (family 25), 2 cores: the commands behind results_final/zen4_1203/.
set -e
OUT=${OUT:-results_final/zen4_1203}
# one forward against llama-bench's, fresh processes taking turns (before the rows-per-pass change)
python benchmarks/forward_vs_llamacpp.py --rounds 3 --out $OUT/forward_vs_llamacpp.json \
  --markdown $OUT/forward_vs_llamacpp.md
# software prefetch: off, hints and distance, in one process (QP_PF_BYTES=0 turns it off)
python benchmarks/weight_stream.py --rounds 20 --variants \
  "t1_16k=;off=-DQP_PF_BYTES=0;t0_16k=-DQP_PF_HINT=3;nta_16k=-DQP_PF_HINT=0;t1_4k=-DQP_PF_BYTES=4096" \
  --markdown $OUT/weight_stream_prefetch.md
# rows per pass over a panel: 16, 12 and 8 (measured before the equal split: passes of QP_R rows, then the rest)
python benchmarks/decode_cost.py --models gemma3-270m,qwen2.5-coder-1.5b --formats auto --rows 8,9,12,16 \
  --context 512 --min-time 4 --variants "r16=-DQP_R=16;r12=;r8=-DQP_R=8" --markdown $OUT/rows_per_pass_variants.md
# the commit before (OLD) and after (NEW), alternating two rounds: rows_{old,new}_{1,2}.*
for r in 1 2; do
  for t in old new; do
    tree=$([ $t = old ] && echo "$OLD" || echo "$NEW")
    (cd "$tree" && python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b,gemma3-270m,smollm2-135m \
      --formats auto --rows 1,8,9,12,16 --context 512 --min-time 3 --markdown "$OUT/rows_${t}_$r.md" \
      --out "$OUT/rows_${t}_$r.json")
  done
done
# two accumulator chains for 1-2 rows (tried, not kept): split_accumulators_not_kept.md, with a
# temporary -DQP_SPLIT switch: --rows 1,2 --min-time 5 --variants "split=;one=-DQP_SPLIT=0"
# servers against native llama-server, after the change
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 1 \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K" \
  --out $OUT/native_qwen1.5b.json --markdown $OUT/native_qwen1.5b.md
# Q4_K with both nibbles of a chunk in one pass (tried, not kept; a temporary -DQ4K_PAIRS switch):
# decode_cost.py --models qwen2.5-coder-1.5b --rows 1,4,8,9 --min-time 6 --variants "pairs=;single=-DQ4K_PAIRS=0"
# -> q4k_pairs_not_kept.md
# attention's prefetch of cached K / V rows: prefetcht1 32 keys ahead (now) against prefetcht0 16 keys ahead (before)
python benchmarks/decode_cost.py --models smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m,qwen2.5-coder-1.5b --formats auto \
  --rows 1,8 --context 512 --min-time 4 --variants "t0_16=-DATT_PF=16 -DATT_PF_HINT=3;t1_32=" --markdown $OUT/att_prefetch_512.md
python benchmarks/decode_cost.py --models smollm2-135m,qwen2.5-coder-1.5b --formats auto --rows 1,8 --context 2048 \
  --min-time 4 --variants "t1_32=;t0_16=-DATT_PF=16 -DATT_PF_HINT=3" --markdown $OUT/att_prefetch_2048.md
python benchmarks/decode_cost.py --models smollm2-135m --formats auto --rows 1,8 --context 2048 --min-time 3 \
  --kv-dtypes int8,fp16 --variants "t1_32=;t0_16=-DATT_PF=16 -DATT_PF_HINT=3" --markdown $OUT/att_prefetch_2048_kvq.md
# the same server run again after the attention prefetch change
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 1 \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K" \
  --out $OUT/native_qwen1.5b_2.json --markdown $OUT/native_qwen1.5b_2.md
# plain decode of the other three models against native llama-server (after both kernel changes)
for m in smollm2-135m gemma3-270m qwen2.5-coder-0.5b; do
  python benchmarks/native_llamacpp.py --model $m --tokens 128 --rounds 2 --limit 2 \
    --configs "llama.cpp plain,specserve plain" --out $OUT/plain_$m.json --markdown $OUT/plain_$m.md
done
# fp32 weights' block prefetch hint, t1 vs t0 (tried with a temporary -DLIN_PF_HINT switch, not kept: +-3%)
# decode_cost.py --models smollm2-135m,qwen2.5-coder-0.5b --formats none --rows 1,8 --context 512 --min-time 4 \
#   --variants "t1=;t0=-DLIN_PF_HINT=3" -> f32_prefetch_not_kept.md
# the build contest's record at the session's last sources
python -c "from specserve.kernels import ops; i=ops.kernels_info(); print({k:i[k] for k in ('variant','variant_ms','variant_source')})" \
  > $OUT/kernel_variant.txt
