#!/bin/sh
# 2026-12-06 (third session), AMD EPYC Zen 5 (family 26 model 2), 2 cores: attention over an fp32 cache
# in tiles (commit 88009ac), and experiments not kept. Run from the repository root.
D=results_final/zen5_1206c
# paged attention alone, tiles against one tile per work item (att_tiles.txt)
python $D/att_tiles.py > $D/att_tiles.txt
# the whole forward at 2048 cached keys, both builds taking turns (decode_cost_tiles_2048.md)
python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b,smollm2-135m --formats auto --rows 1,4,8 \
  --context 2048 --min-time 3 --variants "tiles=;one tile=-DATT_F32_TILE_BYTES=1073741824" \
  --markdown $D/decode_cost_tiles_2048.md
# where a forward at 2048 cached keys goes (fused_breakdown_2048.md)
python benchmarks/forward_breakdown.py --models qwen2.5-coder-1.5b,smollm2-135m --rows 1,4,8 --context 2048 \
  --path fused --rounds 20 --markdown $D/fused_breakdown_2048.md
# not kept: Q4_K's 8-row panel call (kernel_experiments.txt) and attention (att_experiments.txt)
sh $D/kernel_experiments.sh > $D/kernel_experiments.txt
sh $D/att_experiments.sh > $D/att_experiments.txt
# attention's prefetch of an fp32 cache's rows spread through the kernels' loops (ATT_PF_SPREAD), against
# each row's lines at once, in the 512-bit build and the 256-bit one (att_prefetch.txt), and the whole
# forward at 2048 keys (decode_cost_prefetch_2048.md)
python $D/att_tiles.py "burst=-DATT_PF_SPREAD=0;spread=;burst 256-bit=-mno-avx512f -DATT_PF_SPREAD=0;spread 256-bit=-mno-avx512f" \
  > $D/att_prefetch.txt
python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b,smollm2-135m --formats auto --rows 1,4,8 \
  --context 2048 --min-time 3 --variants "spread=;burst=-DATT_PF_SPREAD=0" --markdown $D/decode_cost_prefetch_2048.md
# the KV rows' prefetch under prefetcht0 (the run-time hint's other setting; for attention alone the
# same as building with -DATT_PF_HINT=3) against prefetcht1 (att_hint.txt)
python $D/att_tiles.py "t1=;t0=-DATT_PF_HINT=3" > $D/att_hint.txt
# decode after a long prompt against native llama-server (native_long.md): two prompts of 1,519 and
# 1,893 tokens (qwen2.5-coder's tokenizer), a stdlib module's source and a question
python $D/long_suite.py > $D/long.jsonl
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --suites $D/long.jsonl --limit 2 --rounds 2 --tokens 128 \
  --configs "llama.cpp plain,specserve plain" --out $D/native_long.json --markdown $D/native_long.md
# the same with speculation (native_long_spec.md)
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --suites $D/long.jsonl --limit 2 --rounds 2 --tokens 128 \
  --configs "llama.cpp plain,llama.cpp ngram-mod,specserve plain,specserve suffix,specserve draft q4_0 32K" \
  --out $D/native_long_spec.json --markdown $D/native_long_spec.md
# after the draft model's catch-up is weighed against the answer's length (native_long_payback.md)
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --suites $D/long.jsonl --limit 2 --rounds 2 --tokens 128 \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K" \
  --out $D/native_long_payback.json --markdown $D/native_long_payback.md
# the draft's catch-up on those prompts: estimated and measured, and the answers' draft forwards (draft_catch_up.txt)
python $D/draft_catch_up.py > $D/draft_catch_up.txt
# the 1.5b's linears' arithmetic at 8 rows against this CPU's int8 peak (int_dot_floor.md)
python benchmarks/int_dot_peak.py --rows 8 --formats "" --models qwen2.5-coder-1.5b --context 512 --rounds 10 \
  --markdown $D/int_dot_floor.md
