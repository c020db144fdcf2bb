"""Writes long.jsonl: two chat prompts of 1,519 and 1,893 tokens for qwen2.5-coder (a module of Python's standard library,
cut at a line boundary, and a question about it), for native_llamacpp.py --suites long.jsonl: decode
after a long context, where the attention over the cached K/V costs as much as the weights.

    python results_final/zen5_1206c/long_suite.py > results_final/zen5_1206c/long.jsonl
"""
import inspect
import json
import textwrap

import argparse
import json as json_module

CHARS = 7000  # of Python source

for pid, module, question in (("long-argparse", argparse, "Explain what this code does, class by class."),
                              ("long-json", json_module, "Summarize this module's public API and how it works.")):
    src = inspect.getsource(module)
    cut = src[:CHARS].rsplit("\n", 1)[0]
    text = f"{question}\n\n```python\n{textwrap.dedent(cut)}\n```"
    print(json.dumps({"id": pid, "messages": [{"role": "user", "content": text}]}))
