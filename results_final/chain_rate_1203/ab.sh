#!/bin/bash
# chain [suffix, 4-bit 32K draft] vs that draft alone, before (/tmp/ch_old: a31f148) and after
# (/tmp/ch_new: a31f148 + chain_rate.patch, not kept; rate_only/: the patch without its "promises"
# rule); two rounds alternating, the commands of results_final/chain_1203/ab.sh
OLD=/tmp/ch_old NEW=/tmp/ch_new exec bash "$(dirname "$0")/../chain_1203/ab.sh" "$1"
