#!/bin/sh
# 2026-12-07, AMD EPYC Zen 5 (family 26 model 2), 2 cores: a draft model far behind a sequence reads a
# window of it (draft_window). Run from the repository root; native llama.cpp is built on first use.
D=results_final/zen5_1207
S='{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 8, "quantization": "q4_0", "draft_vocab_size": 32768'
# against native llama-server after the 1,5xx- and 1,9xx-token prompts of long.jsonl, 128- and 384-token answers:
# the draft reading whole prompts (read all), a 512-token window, and the default (1024 when these two ran)
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --suites results_final/zen5_1206c/long.jsonl --limit 2 \
  --rounds 2 --tokens 128 --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K,specserve draft q4_0 32K read all,specserve draft q4_0 32K window 512" \
  --out $D/native_long_window.json --markdown $D/native_long_window.md
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --suites results_final/zen5_1206c/long.jsonl --limit 2 \
  --rounds 2 --tokens 384 --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K,specserve draft q4_0 32K read all,specserve draft q4_0 32K window 512" \
  --out $D/native_long_window_384.json --markdown $D/native_long_window_384.md
# prompts of 4,993 and 3,662 tokens (long6k.jsonl), 256-token answers, our servers only
python results_final/zen5_1206c/long_suite.py 24000 long6k > $D/long6k.jsonl
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --suites $D/long6k.jsonl --limit 2 --rounds 2 --tokens 256 \
  --ctx 8192 --configs "specserve plain,specserve draft q4_0 32K read all,specserve draft q4_0 32K window 512,specserve draft q4_0 32K window 1024" \
  --out $D/native_long6k_window.json --markdown $D/native_long6k_window.md
# the catch-up rule's estimate against what drafting saved, default window (payback_estimate.txt)
python $D/payback_estimate.py 128 > $D/payback_estimate.txt
# all four long prompts in one process, the engines taking turns per prompt (spec_window.md)
python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b --suites results_final/zen5_1206c/long.jsonl,$D/long6k.jsonl \
  --tokens 256 --runs 1 --prompts-per-suite 2 --ctx 8192 --spec "draft read all=$S, \"draft_window\": 0}" \
  --spec "draft window 512=$S, \"draft_window\": 512}" --spec "draft window 1024=$S, \"draft_window\": 1024}" \
  --out $D/spec_window.json --markdown $D/spec_window.md
# the edit suite (one file changed twice; prompts of 217-773 tokens), reading all against the window (spec_window_edit.md)
python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b --suites edit --tokens 256 --runs 1 --prompts-per-suite 10 \
  --ctx 4096 --spec "draft read all=$S, \"draft_window\": 0}" --spec "draft window 512=$S, \"draft_window\": 512}" \
  --out $D/spec_window_edit.json --markdown $D/spec_window_edit.md
# not kept: one-row attention with the KV rows prefetched 8-64 keys ahead, or with prefetcht0 (att_pf.txt)
python $D/att_pf.py "base=;pf16=-DATT_PF=16;pf64=-DATT_PF=64;pf8=-DATT_PF=8;t0=-DATT_PF_HINT=3" > $D/att_pf.txt
# verification width on every catalog model at 512 cached tokens, today's code and machine (decode_cost.md)
python benchmarks/decode_cost.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b --formats auto \
  --rows 1,2,4,8,16 --context 512 --markdown $D/decode_cost.md --out $D/decode_cost.json
# a whole prompt's read by the draft (draft_window 0): the catch-up estimated from start-up's forwards of 512 and
# 1024 rows (wide_time bending with attention's growth) against measured, on all four long prompts (draft_catch_up.txt)
python results_final/zen5_1206c/draft_catch_up.py results_final/zen5_1206c/long.jsonl $D/long6k.jsonl > $D/draft_catch_up.txt
# qwen2.5-coder-1.5b against native llama-server on the four suites with this session's code (native_qwen1.5b.md)
python benchmarks/native_llamacpp.py --model qwen2.5-coder-1.5b --tokens 128 --rounds 2 --limit 2 \
  --configs "llama.cpp plain,specserve plain,specserve draft q4_0 32K" --out $D/native_qwen1.5b.json --markdown $D/native_qwen1.5b.md
# the same, rerun in the review after a refactor of the rule (the same arithmetic; payback_estimate_rerun.txt)
python $D/payback_estimate.py 128 > $D/payback_estimate_rerun.txt
