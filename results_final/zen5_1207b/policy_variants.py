"""The adaptive policy's parts of 2026-12-07 turned off one by one, for this directory's scripts
(each takes an engine's DraftPolicy), the long prompts they read, and the imports they share."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
import spec_decode as sd  # noqa: E402  (the scripts' benchmark helpers)
from specserve.bench.suites import load_suite  # noqa: E402
from specserve.speculative import adaptive  # noqa: E402

__all__ = ["sd", "LONG", "LONG6K", "long_messages", "no_probes", "no_gaps", "no_follow", "before"]
LONG = os.path.join(HERE, "..", "zen5_1206c", "long.jsonl")  # long-argparse (1,548 tokens), long-json
LONG6K = os.path.join(HERE, "..", "zen5_1207", "long6k.jsonl")


def long_messages(path: str = LONG, i: int = 0) -> list[dict]:
    """The chat messages of the i-th prompt of a long-prompt file."""
    return load_suite(path)[1][i].as_messages()


def no_probes(policy):  # a drafting sequence no longer decodes plain now and then to re-time the plain width
    policy._cost_probe_due = lambda *args: False


def no_gaps(policy):  # steps priced at their forwards' time alone (only differs with step_gaps.patch)
    policy.gap = lambda drafting: 0.0


def no_follow(policy):  # the widths keep their own times (no CostModel.ref scaling)
    policy.cost._now = lambda width, table=policy.cost.table: table[width]


def before(policy):  # the policy before 2026-12-07b: none of the above, and no first steps' exploring
    no_probes(policy)
    no_gaps(policy)
    no_follow(policy)
    policy.news = round(1 / adaptive.PRIOR_ALPHA)  # no exploring; the prior moves by PRIOR_ALPHA
