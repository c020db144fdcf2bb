#!/bin/sh
# 2026-12-06 (second session), AMD EPYC Zen 5 (family 26 model 2), 2 cores: qwen2.5-coder-1.5b against
# native llama-server after the prefetch hint moved to a trial over the first real forwards
# (results_final/zen5_1206/run.sh's configurations), one server at a time
D=results_final/zen5_1206b
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 2 \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K" \
  --out $D/native_qwen1.5b.json --markdown $D/native_qwen1.5b.md
# where the fused forward's time goes, from the C library's own stage timers (fused_breakdown.md)
python benchmarks/forward_breakdown.py --models smollm2-135m,qwen2.5-coder-1.5b --rows 1,4,8 --rounds 20 \
  --path fused --markdown $D/fused_breakdown.md
# also here: hint_trials.sh (the prefetch-hint trial in five fresh engines), panel_calls.sh (the
# panel kernel alone, and with Q4_K's sub-block loop unrolled: q4k_unroll.patch, not committed)
# the 1.5b comparison again, later (native_qwen1.5b_run2.md)
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 2 \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K" \
  --out $D/native_qwen1.5b_run2.json --markdown $D/native_qwen1.5b_run2.md
# verification width with the prefetch hint chosen as engines choose it (decode_cost.py --prefetch trial,
# now the default): every catalog model
python benchmarks/decode_cost.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --formats auto --rows 1,2,4,8,16 --context 512 --min-time 1.5 --out $D/decode_cost.json --markdown $D/decode_cost.md
# the int8 dot peak the README's "two thirds of the peak" is measured against (int_dot_peak.md)
python benchmarks/int_dot_peak.py --rows 8 --formats Q4_K --models "" --markdown $D/int_dot_peak.md
# also: smollm2_hint.sh (smollm2's hint trial in three decode_cost processes), catalog.sh
