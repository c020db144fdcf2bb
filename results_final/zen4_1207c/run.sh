#!/bin/sh
# The section "Greedy tokens from a cheaper copy of the LM head" (README), from the repository root.
# candidates.py and hidden.py run on this commit; ab.py and split.py need bounded_head.patch applied.
set -e
D=results_final/zen4_1207c
python $D/hidden.py /tmp/hidden_1.5b.pt
python $D/candidates.py /tmp/hidden_1.5b.pt > $D/candidates.txt
git apply $D/bounded_head.patch
python $D/ab.py > $D/ab.txt
python $D/split.py /tmp/hidden_1.5b.pt > $D/split.txt
git apply -R $D/bounded_head.patch
