"""One-row attention over an fp32 cache at the 1.5b's shapes (att_tiles.py's case), builds with the KV rows
prefetched 8, 16, 32 (the default) or 64 keys ahead, and with prefetcht0, taking turns in one process
(2026-12-07, Zen 5), 21 rounds; with the K / V bytes read per second.

    python results_final/zen5_1207/att_pf.py "base=;pf16=-DATT_PF=16;pf64=-DATT_PF=64;pf8=-DATT_PF=8;t0=-DATT_PF_HINT=3"
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "zen5_1206c")]
from att_tiles import builds, compare  # noqa: E402

compare(builds(sys.argv[1]), [("qwen2.5-coder-1.5b", 2048, 1), ("qwen2.5-coder-1.5b", 8192, 1),
                              ("qwen2.5-coder-1.5b", 2048, 8)], rounds=21, gbps=True)
