#!/bin/sh
# Attention experiments not kept (att_experiments.py; 2026-12-06, AMD EPYC Zen 5 family 26 model 2, 2 cores):
# a copy of the package with att_experiments.patch applied to its kernels (both changes behind macros).
# sh results_final/zen5_1206c/att_experiments.sh > results_final/zen5_1206c/att_experiments.txt
D=$(cd "$(dirname "$0")" && pwd)
T=$(mktemp -d)
cp -r "$D/../../specserve" "$T/specserve"
(cd "$T/specserve/kernels/csrc" && patch -s -p1 < "$D/att_experiments.patch")
PYTHONPATH=$T python "$D/att_experiments.py" 2>&1 | grep -v Warning
rm -rf "$T"
