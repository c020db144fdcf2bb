"""Training data for drafters, by self-distillation: the target answers prompts itself.

The prompts come from :mod:`specserve.speculative.train.prompts` (``--data`` sources and
``--prompts`` files). The target then answers every prompt through its chat template with the real engine
(batched, greedy by default), and one more target forward over prompt + answer captures the
hidden states of the layers the drafter reads.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import SpecserveError

# the prompt sources live in prompts.py; re-exported here, where the training command looks for them
from specserve.speculative.train.prompts import (  # noqa: E402
    Prompt,  # noqa: F401
    SOURCES,  # noqa: F401
    datasets_dir,  # noqa: F401
    debian_prompts,  # noqa: F401
    file_prompts,  # noqa: F401
    load_prompts,  # noqa: F401
    math_prompts,  # noqa: F401
    parse_data_spec,  # noqa: F401
    prompt_files_meta,  # noqa: F401
    sharegpt_prompts,  # noqa: F401
    stdlib_prompts,  # noqa: F401
)

log = logging.getLogger("specserve.train")

# ---- self-distillation ------------------------------------------------------------------------
@dataclass
class Example:
    ids: torch.Tensor  # [T] int64: prompt + answer
    prompt_len: int
    hidden: torch.Tensor  # [T, F] (bfloat16): the drafter's conditioning features
    source: str = ""


def chat_prompt_ids(target, prompt: Prompt) -> list[int]:
    """A user turn's text or chat messages through the target's chat template (without one: the
    messages' texts joined by blank lines)."""
    tok = target.tokenizer
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not tok.chat_template:
        return tok.encode("\n\n".join(m["content"] for m in msgs), add_special_tokens=True)
    from specserve.models.chat_template import ChatTemplate

    rendered = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token).render(msgs)
    return tok.encode(rendered, add_special_tokens=False)


def generate_answers(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                     seed: int = 0, max_num_seqs: int = 8, progress=None, on_done=None,
                     indices: list[int] | None = None) -> list[list[int]]:
    """The target's own answers, from the real engine (continuous batching).

    ``indices`` name the prompts (default 0..n-1; a sampled answer's seed depends on it, so a
    resumed generation gives the same answers); ``on_done(index, answer)`` is called as each
    answer finishes."""
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.engine.types import SamplingParams

    indices = list(range(len(prompts))) if indices is None else indices
    max_len = min(max(len(p) for p in prompts) + max_new_tokens + 8, target.config.max_position)
    ecfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_len, enable_prefix_caching=False, seed=seed)
    engine = LLMEngine(target, ecfg)
    answers: dict[str, list[int]] = {}
    pending = list(zip(indices, prompts))
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
                if on_done is not None:
                    on_done(int(out.request_id[1:]), answers[out.request_id])
                if progress and (done % 64 == 0 or done == len(prompts)):
                    progress(f"generated {done}/{len(prompts)} answers")
    return [answers[f"g{i}"] for i in indices]


@torch.inference_mode()
def capture_hidden(target, seqs: list[list[int]], layers: tuple[int, ...], final_norm: bool = False,
                   max_batch_tokens: int = 2048, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", progress=None) -> list[torch.Tensor]:
    """Target hidden states of ``layers`` (concatenated, [T, len(layers)*H], float32 unless
    ``dtype``, on ``device``) for every token of each sequence; with final_norm, the target's
    final norm is applied (one layer). progress: called with a line at every tenth of the tokens."""
    from specserve.models.layers import rms_norm
    from specserve.engine.model_runner import BatchEntry, build_forward_batch
    from specserve.models.hybrid import RecurrentStates
    from specserve.models.transformer import KVCache

    model, cfg = target.model, target.config
    dev = model.device
    bs = 16
    out: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
    order = list(range(len(seqs)))
    i, done, total_tokens, reported = 0, 0, sum(len(s) for s in seqs), 0
    while i < len(order):
        group, total = [], 0
        while i < len(order) and (not group or total + len(seqs[order[i]]) <= max_batch_tokens):
            group.append(order[i])
            total += len(seqs[order[i]])
            i += 1
        blocks = [-(-len(seqs[g]) // bs) for g in group]
        kv = KVCache.allocate(cfg, sum(blocks), bs, model.dtype, dev)
        if cfg.hybrid:  # every sequence starts from the zero state; no state is kept
            kv.states = RecurrentStates.allocate(cfg, 1, 1, dev)
        entries, base = [], 0
        for g, nb in zip(group, blocks):  # each sequence's blocks follow the previous one's
            state = (0, -1, [-1] * len(seqs[g]), -1, [-1] * len(seqs[g])) if cfg.hybrid else None
            entries.append(BatchEntry(seqs[g], 0, [list(range(base, base + nb))], state))
            base += nb
        batch = build_forward_batch(entries, bs, max(blocks), [sum(len(seqs[g]) for g in group) - 1], dev,
                                    hidden_layers=tuple(layers))
        res = model.forward(batch, kv)
        feats = torch.cat([res.hidden[layer].float() for layer in layers], dim=-1)
        if final_norm:
            feats = rms_norm(feats.to(model.dtype).contiguous(), model.final_norm, cfg.rms_eps).float()
        start = 0
        for g in group:
            n = len(seqs[g])
            out[g] = feats[start:start + n].to(device=device, dtype=dtype)
            start += n
        done += total
        if progress and done * 10 // total_tokens > reported:
            reported = done * 10 // total_tokens
            progress(f"hidden states: {i}/{len(seqs)} sequences, {done}/{total_tokens} tokens")
    return out


@dataclass
class Answer:
    """A prompt and the target's answer, as token ids (no hidden states yet)."""

    ids: list[int]  # prompt + answer, cut to the training window
    prompt_len: int
    source: str = ""


def prompt_ids(target, prompts: list[tuple[str, Prompt]], max_new_tokens: int, max_len: int,
               progress=None) -> list[tuple[int, str, list[int]]]:
    """[(prompt index, source, chat-templated ids)] of the prompts that fit the window."""
    out = []
    for i, (src, prompt) in enumerate(prompts):
        p = chat_prompt_ids(target, prompt)
        if len(p) + max_new_tokens <= max_len:  # longer ones do not fit the training window
            out.append((i, src, p))
    if not out:
        raise SpecserveError("no usable prompts (all too long for --seq-len?)")
    if progress and len(out) < len(prompts):
        progress(f"skipped {len(prompts) - len(out)} prompts longer than --seq-len minus the answer length")
    return out


def build_answers(target, prompts: list[tuple[str, Prompt]], *, max_new_tokens: int, max_len: int,
                  temperature: float = 0.0, seed: int = 0, max_num_seqs: int = 8, progress=None,
                  path: Path | None = None, meta: dict | None = None, save_every: int = 256) -> list[Answer]:
    """Prompts -> the target's answers. With ``path``, finished answers are saved as they come
    (every ``save_every``) and a later call with the same ``meta`` generates only the missing ones."""
    max_new_tokens = max(1, min(max_new_tokens, max_len // 2))
    todo = prompt_ids(target, prompts, max_new_tokens, max_len, progress)
    have: dict[int, Answer] = load_answers(path, meta) if path is not None and path.is_file() else {}
    if have and progress:
        progress(f"{len(have)} answers already in {path}")
    missing = [(i, src, p) for i, src, p in todo if i not in have]
    random.Random(seed).shuffle(missing)  # sources interleaved: a run stopped early keeps a mix
    sources = {i: src for i, src, _ in todo}
    prompt_of = {i: p for i, _, p in missing}
    fresh = 0

    def done(i: int, answer: list[int]) -> None:
        nonlocal fresh
        have[i] = Answer((prompt_of[i] + answer)[:max_len], len(prompt_of[i]), sources[i])
        fresh += 1
        if path is not None and fresh % save_every == 0:
            save_answers(have, path, meta or {})

    if missing:
        generate_answers(target, [p for _, _, p in missing], max_new_tokens, temperature, seed, max_num_seqs,
                         progress, on_done=done, indices=[i for i, _, _ in missing])
        if path is not None:
            save_answers(have, path, meta or {})
    return trainable({i: have[i] for i, _, _ in todo})


def trainable(answers: dict[int, Answer]) -> list[Answer]:
    """The answers in prompt order, without those too short to train on (< 2 answer tokens)."""
    return [answers[i] for i in sorted(answers) if len(answers[i].ids) - answers[i].prompt_len >= 2]


def sample_answers(answers: dict[int, Answer], n: int | None, seed: int) -> dict[int, Answer]:
    """A random n of the answers (all of them when n is None or not smaller), the same for a seed."""
    if n is None or n >= len(answers):
        return answers
    keys = sorted(answers)
    random.Random(seed).shuffle(keys)
    return {k: answers[k] for k in keys[:n]}


def save_answers(answers: dict[int, Answer], path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    recs = {i: (torch.tensor(a.ids, dtype=torch.int32), a.prompt_len, a.source) for i, a in answers.items()}
    torch.save({"meta": meta, "answers": recs}, str(path) + ".tmp")
    Path(str(path) + ".tmp").replace(path)


def load_answers(path: Path, meta: dict | None = None) -> dict[int, Answer]:
    """The answers saved at path ({} when they were made with another meta)."""
    obj = torch.load(str(path), weights_only=True)
    if meta is not None and obj["meta"] != meta:
        return {}
    return {int(i): Answer(t.tolist(), int(pl), s) for i, (t, pl, s) in obj["answers"].items()}


def load_compatible_answers(path: Path, meta: dict) -> dict[int, Answer]:
    """Another run's answers, made for the same model (and vocabulary) and training window as ``meta``'s;
    its prompts, seed and answer length may differ. Raises SpecserveError otherwise."""
    try:
        other = torch.load(str(path), weights_only=True)["meta"]
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same error
        raise SpecserveError(f"--more-answers {path}: not an answers.pt file ({type(exc).__name__})") from exc
    for key in ("model", "vocab", "seq_len"):
        if other.get(key) != meta.get(key):
            raise SpecserveError(f"--more-answers {path}: made with {key} {other.get(key)!r}, this run has "
                                 f"{meta.get(key)!r}")
    return load_answers(path)


def merge_answers(answers: dict[int, Answer], more: dict[int, Answer]) -> dict[int, Answer]:
    """``answers`` followed by those of ``more`` whose token ids are not in it yet (prompt order kept)."""
    out = dict(answers)
    seen = {tuple(a.ids) for a in answers.values()}
    start = max(out, default=-1) + 1
    for i in sorted(more):
        key = tuple(more[i].ids)
        if key not in seen:
            seen.add(key)
            out[start + len(out) - len(answers)] = more[i]
    return out


def examples_from_answers(target, answers: list[Answer], *, layers: tuple[int, ...], final_norm: bool,
                          progress=None, max_batch_tokens: int = 2048,
                          device: str | torch.device = "cpu") -> list[Example]:
    """Answers -> examples with the target's captured hidden states (bfloat16, on ``device``)."""
    if progress:
        progress(f"capturing hidden states of {len(answers)} sequences")
    hidden = capture_hidden(target, [a.ids for a in answers], layers, final_norm, max_batch_tokens,
                            torch.bfloat16, device, progress)
    return [Example(torch.tensor(a.ids, dtype=torch.int64), a.prompt_len, h, a.source)
            for a, h in zip(answers, hidden)]


def save_dataset(examples: list[Example], path: Path, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"meta": meta, "examples": [(e.ids, e.prompt_len, e.hidden.cpu(), e.source) for e in examples]},
               str(path) + ".tmp")
    Path(str(path) + ".tmp").replace(path)


def load_dataset(path: Path) -> tuple[list[Example], dict]:
    obj = torch.load(str(path), weights_only=True)
    return [Example(i, int(p), h, s) for i, p, h, s in obj["examples"]], obj["meta"]
