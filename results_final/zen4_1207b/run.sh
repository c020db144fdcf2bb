#!/bin/sh
# 2026-12-07, AMD EPYC Zen 4 (family 25 model 17), 2 cores, nothing else running:
# the panel kernel's Q4_K calls, committed source against the unrolled sub-block loop, in L2 and streamed
# (the Zen 5 script, unchanged), and where a speculative step of the 1.5b with the 4-bit draft goes.
D=$(cd "$(dirname "$0")" && pwd)
sh "$D/../zen5_1206b/panel_calls.sh" > "$D/panel_calls.txt"
python "$D/step_split.py" > "$D/step_split.txt"
# The whole forward, once, from a tree with q4k_unroll.patch applied (unroll_forward.txt):
#   python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b --formats auto --rows 1,3,5,8 --context 512
#     --min-time 3 --variants "new=;old=-DQP_UNROLL_ROWS=0"
# step_split_run1.txt: the same measurement half an hour earlier, printed by an earlier copy of step_split.py.
