"""The adaptive policy's parts of 2026-12-07 on and off, in one process (Zen 5).

qwen2.5-coder-1.5b plain, and with the 0.5b draft (q4_0, 32K draft vocabulary, adaptive) in several
variants (--variants, comma-separated): all = as the engine runs it; no-probes = without cost probes
(a drafting sequence no longer decodes plain now and then to re-time the plain width, which then
stays as start-up measured it); no-gaps = without the steps' gaps (a step priced at its forwards'
time alone); no-follow = a width measured before the latest one-row time keeps its own time instead
of following the one-row time's move since (CostModel.ref); before = the policy before the day's
parts (no cost probes, no first steps' exploring: whether the engine drafts at all starts from a 0.5
prior against its start-up timing; no gaps). The default is
all,no-probes,before. Rounds and order as benchmarks/spec_decode.py. Per engine at the end: its
table's one-row time, how many passes ago it was measured, and the prior; the plain engine's
one-row time is the reference (it runs one-row forwards all along).

    python results_final/zen5_1207b/cost_probe_ab.py [--variants all,no-gaps] [spec_decode.py options]

(cost_probe_ab_run1.txt: the first version of this script, before the exploring existed, with two
drafting engines: as run then, and without cost probes. cost_probe_ab.txt: the default variants,
before the gaps existed (its "neither (as before)" is this script's before without no_gaps).
step_gaps_ab.txt: --variants all,no-gaps, with step_gaps.patch applied; the gaps were not kept, and
without the patch no-gaps is the same policy as all. follow_ab.txt: --variants all,no-follow.
cost_probe_ab.txt was taken before CostModel.ref existed; before now turns it off too.)
"""
import sys

from policy_variants import before, no_follow, no_gaps, no_probes, sd

SPEC = dict(sd.FAST_DRAFT)
VARIANTS = {"all": ("draft q4_0 32K", lambda policy: None), "no-probes": ("draft q4_0 32K, no cost probes", no_probes),
            "no-gaps": ("draft q4_0 32K, no step gaps", no_gaps), "before": ("draft q4_0 32K, as before", before),
            "no-follow": ("draft q4_0 32K, stale widths keep their times", no_follow)}
chosen = ["all", "no-probes", "before"]  # --variants a,b,...: which (the default: the first run's three)
if "--variants" in sys.argv:
    i = sys.argv.index("--variants")
    chosen = sys.argv[i + 1].split(",")
    del sys.argv[i:i + 2]
engines_seen = {}


def adjust(engines):
    for key in chosen:
        name, change = VARIANTS[key]
        change(engines[name].policy)
    engines_seen.update(engines)


sys.argv[1:1] = ["--models", "qwen2.5-coder-1.5b"] + [
    a for key in chosen for a in ("--spec", VARIANTS[key][0] + "=" + sd.json.dumps(SPEC))]
sd.main(adjust)
for name, eng in engines_seen.items():
    cost = eng.cost
    print(f"{name}: one row {cost.time(1) * 1e3:.1f} ms, measured {cost.age(1)} timed passes ago; "
          f"{cost.timed} passes timed; prior {eng.policy.prior:.2f}")
