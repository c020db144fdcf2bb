"""The A/B table of README "A sequence drafting nothing drafts again": per round the speedup of the
draft over plain on all suites (median of paired ratios, from each run's markdown), and over all
rounds per suite the mean of the paired ratios, the lowest one, and the mean over everything.

    python results_final/slow_revert_1206/summary.py
"""

import json
import os
import re
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
SUITES = ("code", "math", "prose", "edit")
for tree in ("old", "new"):
    rounds, ratios = [], []
    for r in (1, 2, 3):
        path = os.path.join(HERE, f"{tree}_r{r}.md")
        if not os.path.exists(path):
            continue
        rounds.append(re.search(r"\| draft \| all \|[^|]*\| ([0-9.]+x)", open(path).read()).group(1))
        rows = json.load(open(os.path.join(HERE, f"{tree}_r{r}.json")))
        rows = rows["rows"] if isinstance(rows, dict) else rows
        ratios += [(x["suite"], x["ratio"]) for x in rows if x["config"] == "draft"]
    per = [f"{s} {statistics.mean(v for u, v in ratios if u == s):.2f}x (lowest {min(v for u, v in ratios if u == s):.2f}x)"
           for s in SUITES]
    print(f"{tree}: rounds {' / '.join(rounds)}; {'; '.join(per)}; mean of {len(ratios)} paired ratios "
          f"{statistics.mean(v for _, v in ratios):.2f}x")
