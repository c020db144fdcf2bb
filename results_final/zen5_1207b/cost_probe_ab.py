"""The policy's cost probes and first-steps exploring, on and off, in one process (2026-12-07, Zen 5).

qwen2.5-coder-1.5b plain, and with the 0.5b draft (q4_0, 32K draft vocabulary, adaptive) three
times: as the engine runs it; without cost probes (a drafting sequence no longer decodes plain now
and then to re-time the plain width, which then stays as start-up measured it); and with neither
the cost probes nor the first steps' exploring (the policy before 2026-12-07b: whether the engine
drafts at all starts from a 0.5 prior against its start-up timing). Rounds and order as
benchmarks/spec_decode.py. Per engine at the end: its table's one-row time, how many passes ago it
was measured, and the prior; the plain engine's one-row time is the reference (it runs one-row
forwards all along).

    python results_final/zen5_1207b/cost_probe_ab.py [spec_decode.py options] > cost_probe_ab.txt

(cost_probe_ab_run1.txt: the first version of this script, before the exploring existed, with
two drafting engines: as run then, and without cost probes.)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import spec_decode as sd  # noqa: E402
from specserve.speculative import adaptive  # noqa: E402

SPEC = dict(sd.FAST_DRAFT)
NO_PROBES = "draft q4_0 32K, no cost probes"
BEFORE = "draft q4_0 32K, neither (as before)"
engines_seen = {}


def adjust(engines):
    for name in (NO_PROBES, BEFORE):
        engines[name].policy._cost_probe_due = lambda *args: False
    engines[BEFORE].policy.news = round(1 / adaptive.PRIOR_ALPHA)  # no exploring; the prior moves by PRIOR_ALPHA
    engines_seen.update(engines)


sys.argv[1:1] = ["--models", "qwen2.5-coder-1.5b"] + [
    a for name in ("draft q4_0 32K", NO_PROBES, BEFORE) for a in ("--spec", name + "=" + sd.json.dumps(SPEC))]
ap_main = sd.main
orig = sd.bench_model
sd.bench_model = lambda model, a, suites: orig(model, a, suites, adjust)
ap_main()
for name, eng in engines_seen.items():
    cost = eng.cost
    print(f"{name}: one row {cost.time(1) * 1e3:.1f} ms, measured {cost.age(1)} timed passes ago; "
          f"{cost.timed} passes timed; prior {eng.policy.prior:.2f}")
