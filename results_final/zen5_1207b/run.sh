# 2026-12-07, second session (AMD EPYC Zen 5, family 26 model 2, 2 cores): the commands behind
# README "The one-row time re-timed, and a new engine's first drafts", "A long conversation's next
# turn reads only what is new" and "A step's time beyond its forwards: tried and not kept".
set -e
cd "$(dirname "$0")"
python cost_probe_ab.py --tokens 128 --runs 2 --prompts-per-suite 2 --suites code,math,prose --out cost_probe_ab.json > cost_probe_ab.txt
python first_drafts.py 10 64 > first_drafts.txt
python ../zen5_1207/payback_estimate.py 128 > payback_estimate.txt
python multi_turn.py 128 > multi_turn.txt
python multi_turn_trace.py > multi_turn_trace.txt
python acceptance_model.py > acceptance_model.txt
# with step_gaps.patch applied (git apply; not kept):
# python step_gaps.py 128 > step_gaps.txt
# python cost_probe_ab.py --variants all,no-gaps --tokens 128 --runs 2 --prompts-per-suite 2 --suites code,math,prose --out step_gaps_ab.json > step_gaps_ab.txt
# python multi_turn.py 128 gaps > multi_turn_gaps.txt
# cost_probe_ab_run1.txt came from this script's first version (two drafting engines: as run, and no cost probes)
python first_request.py 9 64 > first_request.txt
python first_request.py 9 64 stale > first_request_stale.txt
python cost_probe_ab.py --variants all,no-follow --tokens 128 --runs 2 --prompts-per-suite 2 --suites code,math,prose --out follow_ab.json > follow_ab.txt
