#!/bin/sh
# The sections "Greedy tokens from a cheaper copy of the LM head" and "A draft model with layers left out"
# (README), from the repository root.
# candidates.py, hidden.py and draft_layers.py run on this commit; ab.py and split.py need bounded_head.patch applied.
set -e
D=results_final/zen4_1207c
python $D/hidden.py /tmp/hidden_1.5b.pt
python $D/candidates.py /tmp/hidden_1.5b.pt > $D/candidates.txt
git apply $D/bounded_head.patch
python $D/ab.py > $D/ab.txt
python $D/split.py /tmp/hidden_1.5b.pt > $D/split.txt
git apply -R $D/bounded_head.patch
git apply $D/bounded_head_c.patch
python $D/split_c.py /tmp/hidden_1.5b.pt > $D/split_c.txt
for m in qwen2.5-coder-1.5b qwen2.5-coder-0.5b gemma3-270m; do python $D/ab.py $m > $D/ab_c_$m.txt; done
git apply -R $D/bounded_head_c.patch
python $D/draft_layers.py > $D/draft_layers.txt
