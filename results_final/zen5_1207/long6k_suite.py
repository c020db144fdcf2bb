"""Writes long6k.jsonl: two chat prompts of 4,993 and 3,662 tokens for qwen2.5-coder (a module of Python's standard library,
cut at a line boundary, and a question about it), for native_llamacpp.py --suites long6k.jsonl: decode
after a long context, where the attention over the cached K/V costs as much as the weights.

    python results_final/zen5_1207/long6k_suite.py > results_final/zen5_1207/long6k.jsonl
"""
import inspect
import json
import textwrap

import argparse
import json as json_module

CHARS = 24000  # of Python source

for pid, module, question in (("long6k-argparse", argparse, "Explain what this code does, class by class."),
                              ("long6k-json", json_module, "Summarize this module's public API and how it works.")):
    src = inspect.getsource(module)
    cut = src[:CHARS].rsplit("\n", 1)[0]
    text = f"{question}\n\n```python\n{textwrap.dedent(cut)}\n```"
    print(json.dumps({"id": pid, "messages": [{"role": "user", "content": text}]}))
