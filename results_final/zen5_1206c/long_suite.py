"""Writes long.jsonl: two chat prompts of 1,519 and 1,893 tokens for qwen2.5-coder (a module of Python's standard library,
cut at a line boundary, and a question about it), for native_llamacpp.py --suites long.jsonl: decode
after a long context, where the attention over the cached K/V costs as much as the weights.

    python results_final/zen5_1206c/long_suite.py > results_final/zen5_1206c/long.jsonl

With CHARS and a NAME: the modules cut at CHARS characters instead of 7000, the prompts' ids starting with NAME
(results_final/zen5_1207/long6k.jsonl: 24000 long6k, prompts of 4,993 and 3,662 tokens, the json module whole).
"""
import inspect
import json
import sys
import textwrap

import argparse
import json as json_module

CHARS = int(sys.argv[1]) if len(sys.argv) > 1 else 7000  # of Python source
NAME = sys.argv[2] if len(sys.argv) > 2 else "long"

for pid, module, question in ((f"{NAME}-argparse", argparse, "Explain what this code does, class by class."),
                              (f"{NAME}-json", json_module, "Summarize this module's public API and how it works.")):
    src = inspect.getsource(module)
    cut = src[:CHARS].rsplit("\n", 1)[0]
    text = f"{question}\n\n```python\n{textwrap.dedent(cut)}\n```"
    print(json.dumps({"id": pid, "messages": [{"role": "user", "content": text}]}))
