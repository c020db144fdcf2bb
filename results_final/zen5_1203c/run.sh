#!/bin/sh
# 2026-12-03, AMD EPYC Zen 5 (family 26; AVX-512 full width, VNNI), 2 cores: the commands behind README
# "Attention: two query vectors per register". Run from the repository root. ("old" in attention_ab:
# -DATT_PAIRS=0, the 256-bit multi-vector kernel; the kernel before the change: att_kernel_old_*.txt)
D=results_final/zen5_1203c
# verification width on every catalog model
python benchmarks/decode_cost.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --formats auto --rows 1,2,4,8,16 --context 512 --min-time 2 --out $D/decode_cost.json --markdown $D/decode_cost.md
# the new attention against the old one (-DATT_PAIRS=0), in one process, interleaved
python benchmarks/decode_cost.py --models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b \
  --formats auto --rows 1,8 --context 512 --min-time 3 --variants "pairs=;old=-DATT_PAIRS=0" \
  --out $D/attention_ab.json --markdown $D/attention_ab.md
# the attention alone against the kernel before the change (commit c6d32e0), three runs each, alternating
git worktree add /tmp/before c6d32e0
for i in 1 2 3; do
  (cd /tmp/before && PYTHONPATH=/tmp/before python benchmarks/kernels.py --attention --formats f32 --rows 1 --shapes 1) \
    > $D/att_kernel_old_$i.txt
  python benchmarks/kernel_times.py --attention --formats f32 --rows 1 --shapes 1 > $D/att_kernel_new_$i.txt  # kernels.py then
done
git worktree remove /tmp/before
