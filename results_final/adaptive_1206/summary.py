"""The A/B table of README "A sequence stuck at k = 0": per round the speedup of the draft over
plain on all suites (median of paired ratios, from each run's markdown), and over all rounds the
mean of the paired ratios and how many reach 1.66x.

    python results_final/adaptive_1206/summary.py
"""

import json
import os
import re
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
for tree in ("old", "new"):
    rounds, ratios = [], []
    for r in (1, 2, 3):
        md = open(os.path.join(HERE, f"{tree}_r{r}.md")).read()
        rounds.append(re.search(r"\| draft \| all \|[^|]*\| ([0-9.]+x)", md).group(1))
        rows = json.load(open(os.path.join(HERE, f"{tree}_r{r}.json")))
        rows = rows["rows"] if isinstance(rows, dict) else rows
        ratios += [x["ratio"] for x in rows if x["config"] == "draft"]
    print(f"{tree}: rounds {' / '.join(rounds)}; mean of {len(ratios)} paired ratios "
          f"{statistics.mean(ratios):.2f}x; {sum(x >= 1.66 for x in ratios)} at 1.66x or more")
