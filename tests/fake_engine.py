"""The server tests' engine: specserve's own AsyncEngine and LLMEngine over a scripted "model".

Everything between the HTTP layer and the model is the real thing: the request queue and the
step thread, the scheduler, the paged KV cache with prefix caching, the sampler and logprobs,
speculative verification and its counters, the detokenizer with its stop rules, aborts and
failures. Only the network is replaced, so a test knows the text a request gets:

- ``responder(prompt_text, params) -> str`` decides a request's text (default: SCRIPT), one
  token per character (``CharTokenizer``); after it the model puts its mass on EOS, unless
  ignore_eos, where the text repeats until max_tokens;
- ``ScriptedModel`` reads each row's context (the token ids) back from the KV cache through the
  row's block table, as attention reads keys, and gives the next character of the text a logit
  of 30 (every other token 0): chunked prefill, prefix-cache hits and rollbacks all run through
  the engine's own paths;
- with speculation on, ``ScriptedDrafter`` proposes the draft length the engine asks for, of
  which the first ``accept_pattern[step % len]`` tokens are the text's next ones and the rest a
  wrong token: verification decides what is kept;
- ``gate`` (a threading.Event): while set to one that is shut, the engine does not step once every
  sequence has had an output and none waits (requests stay in flight, whatever the machine's
  speed); ``step_delay`` seconds of sleep before each step; ``no_steps`` (set: no step runs; call
  ``hold_steps`` to set it, which waits until the step thread has seen it); ``fail_next``: raised by the next
  generate(); ``prompts`` / ``requests`` / ``finished`` / ``aborted`` record what came and how it ended.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from types import SimpleNamespace
from typing import AsyncIterator, Callable

import torch

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.config import EngineConfig, kv_bytes_per_token
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.sequence import Sequence
from specserve.engine.types import RequestOutput, SamplingParams
from specserve.models.config import ModelConfig
from specserve.models.loader import LoadedModel
from specserve.models.transformer import ForwardBatch, ForwardOutput, KVCache
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.drafter import Drafter, Proposal

SCRIPT = "Hello there! This is a scripted answer from the fake engine."
SCRIPT_TOKENS = len(SCRIPT) + 1  # its completion tokens: one per character, and EOS (counted, as vLLM does)

# <|role|>content per message; echoes template kwargs so tests can see them
FAKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if greeting is defined %}[greeting={{ greeting }}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)

CHARS = 0x3000  # characters with a token of their own (U+0000 .. U+2FFF); any other encodes as "?"
SURE = 30.0  # the scripted token's logit (every other token: 0)


def _char_backend():
    """A `tokenizers` Tokenizer over the same ids (the engine's incremental detokenizer decodes
    through it): one word per character, fused back without spaces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {s: i for i, s in enumerate(CharTokenizer.SPECIALS)}
    vocab.update({chr(c): c + CharTokenizer.OFFSET for c in range(CHARS)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(s, special=True) for s in CharTokenizer.SPECIALS])
    return backend


class CharTokenizer:
    """One token per character; <pad>=0, <s>=1, </s>=2 are special."""

    SPECIALS = ("<pad>", "<s>", "</s>")
    OFFSET = 3

    def __init__(self, chat_template: str | None = FAKE_TEMPLATE):
        self.chat_template = chat_template
        self.bos_token = "<s>"
        self.eos_token = "</s>"
        self.add_bos = True
        self.vocab_size = self.OFFSET + CHARS
        self.eos_id = 2
        self.eos_token_ids = frozenset({2})
        self.bos_token_id = 1
        self.backend = _char_backend()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for sid, special in enumerate(self.SPECIALS):
                if text.startswith(special, i):
                    ids.append(sid)
                    i += len(special)
                    break
            else:
                ids.append((ord(text[i]) if ord(text[i]) < CHARS else ord("?")) + self.OFFSET)
                i += 1
        return ([1] + ids) if add_special_tokens and self.add_bos else ids

    def encode_plain(self, text: str) -> list[int]:
        return [(ord(ch) if ord(ch) < CHARS else ord("?")) + self.OFFSET for ch in text]

    def id_to_token(self, i: int) -> str:
        return self.SPECIALS[i] if i < self.OFFSET else chr(i - self.OFFSET)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if (i < self.OFFSET and skip_special_tokens) else self.id_to_token(i) for i in ids)

    def token_bytes(self, i: int) -> bytes:
        return self.id_to_token(i).encode()

    def all_token_bytes(self) -> list[bytes]:
        return [self.token_bytes(i) for i in range(self.vocab_size)]

    def text_only(self):
        """Like Tokenizer.text_only: special tokens' spellings read as the characters."""
        def encode(text, add_special_tokens=False):
            return SimpleNamespace(ids=self.encode_plain(text))

        return SimpleNamespace(encode=encode)


class Scripts:
    """Each prompt's scripted continuation (token ids): what the model and the drafter read."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id
        self.by_len: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self.lock = threading.Lock()

    def add(self, prompt: list[int], script: list[int]) -> None:
        with self.lock:
            self.by_len.setdefault(len(prompt), {})[tuple(prompt)] = script

    def next_tokens(self, context: list[int], n: int) -> list[int]:
        """The n tokens that follow ``context`` (a prompt and what came after it): the script's
        continuation while the context follows the script, EOS after it or off it."""
        with self.lock:
            for length in sorted(self.by_len, reverse=True):
                script = self.by_len[length].get(tuple(context[:length])) if len(context) >= length else None
                if script is not None:
                    done = context[length:]
                    if script[:len(done)] != done:
                        return [self.eos_id] * n
                    tail = script[len(done):len(done) + n]
                    return tail + [self.eos_id] * (n - len(tail))
        return [self.eos_id] * n


class ScriptedModel(torch.nn.Module):
    """A one-layer "model" whose KV cache holds the token ids: a row's logits peak at the next
    token of its context's script. K row of a token = (token id, 0), V row = zeros."""

    def __init__(self, scripts: Scripts, vocab: int, max_len: int):
        super().__init__()
        self.scripts = scripts
        self.cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=2, intermediate_size=2, num_layers=1,
                               num_heads=1, num_kv_heads=1, head_dim=2, rms_eps=1e-6, rope_theta=10000.0,
                               max_position=max_len)
        self.device, self.dtype, self.tp = torch.device("cpu"), torch.float32, None

    def weight_bytes(self) -> int:
        return 0

    @property
    def head_size(self) -> int:  # the logits' width
        return self.cfg.vocab_size

    def forward(self, batch: ForwardBatch, kv: KVCache) -> ForwardOutput:
        paging = batch.paging[0]
        k = torch.zeros(batch.input_ids.shape[0], 1, 2)
        k[:, 0, 0] = batch.input_ids.float()  # ids < 2**24: exact in float32
        kv.write(0, paging.slot_mapping, k, torch.zeros_like(k))
        pool = kv.k[0].reshape(-1, 2)[:, 0]  # [slots]: the token id at each slot
        bs = kv.k[0].shape[1]
        rows = batch.logits_indices.tolist()
        logits = torch.zeros(len(rows), self.cfg.vocab_size)
        for j, r in enumerate(rows):
            pos = torch.arange(int(batch.positions[r]) + 1)
            table = paging.block_tables[int(batch.seq_ids[r])].long()
            context = pool[table[pos // bs] * bs + pos % bs].long().tolist()
            logits[j, self.scripts.next_tokens(context, 1)[0]] = SURE
        return ForwardOutput(logits)


class ScriptedDrafter(Drafter):
    """Drafts whose first ``accept_pattern[step % len]`` tokens are the script's next ones."""

    name = "scripted"

    def __init__(self, scripts: Scripts, accept_pattern: tuple[int, ...], wrong: int):
        self.scripts, self.accept_pattern, self.wrong = scripts, accept_pattern, wrong

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, num_tokens):
            step = seq.drafter_state.get(self.name, 0)
            seq.drafter_state[self.name] = step + 1
            right = self.scripts.next_tokens(seq.token_ids, k)
            good = min(self.accept_pattern[step % len(self.accept_pattern)], k)
            out.append(Proposal(right[:good] + [self.wrong if t != self.wrong else self.wrong + 1
                                                for t in right[good:]]))
        return out


class FakeEngine(AsyncEngine):
    def __init__(self, *, model_name: str = "fake-model", chat_template: str | None = FAKE_TEMPLATE,
                 max_model_len: int = 512, spec: bool = True, num_spec_tokens: int = 4,
                 accept_pattern: tuple[int, ...] = (2, 0, 4, 1, 3), step_delay: float = 0.0,
                 kv_blocks: int = 256, block_size: int = 16,
                 responder: Callable[[str, SamplingParams], str] | None = None):
        tokenizer = CharTokenizer(chat_template)
        self.scripts = Scripts(tokenizer.eos_id)
        model = ScriptedModel(self.scripts, tokenizer.vocab_size, max_model_len)
        target = LoadedModel(model_name, None, model.cfg, model, tokenizer, "scripted")
        per_token = kv_bytes_per_token(model.cfg, "fp32")
        ecfg = EngineConfig(max_model_len=max_model_len, block_size=block_size,
                            kv_cache_memory=kv_blocks * block_size * per_token, kv_cache_dtype="fp32")
        speculative, drafter = None, None
        if spec:
            speculative = SpeculativeConfig("ngram", num_speculative_tokens=num_spec_tokens, adaptive=False)
            drafter = ScriptedDrafter(self.scripts, accept_pattern, tokenizer.encode("#")[0])
        super().__init__(LLMEngine(target, ecfg, speculative, drafter), model_name)
        self.responder = responder or (lambda prompt, params: SCRIPT)
        self.step_delay = step_delay
        self.gate: threading.Event | None = None
        self.fail_next: BaseException | None = None  # raised by the next generate() before its first output
        self.no_steps: threading.Event | None = None  # while set, no step runs (requests wait, unstarted)
        self.idle_loops = 0  # loops of the step thread that ran no step (held, or no_steps)
        self.prompts: list[str] = []  # decoded prompts, in arrival order
        self.requests: list[tuple[str, SamplingParams]] = []
        self.aborted: list[str] = []
        self.finished: dict[str, str] = {}

    @classmethod
    def from_args(cls, args: argparse.Namespace, own_thread: bool = True) -> "FakeEngine":
        return cls(spec=bool(getattr(args, "speculative_config", None)))

    @property
    def failed_with(self) -> BaseException | None:
        return self._closed

    @property
    def accept_pattern(self) -> tuple[int, ...]:
        return self.engine.drafter.accept_pattern

    @accept_pattern.setter
    def accept_pattern(self, pattern: tuple[int, ...]) -> None:
        self.engine.drafter.accept_pattern = pattern

    def _script_ids(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        text = self.responder(self.tokenizer.decode(prompt_ids, skip_special_tokens=False), params)
        ids = self.tokenizer.encode(text)
        if params.ignore_eos:
            ids = (ids or self.tokenizer.encode(".")) * math.ceil(params.max_tokens / max(1, len(ids) or 1))
        return ids

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       images: list | None = None) -> AsyncIterator[RequestOutput]:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        self.engine.validate(prompt_ids, params)
        self.scripts.add(list(prompt_ids), self._script_ids(prompt_ids, params))
        self.prompts.append(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        self.requests.append((request_id, params))
        ended = False
        try:
            async for out in super().generate(prompt_ids, params, request_id, images):
                if out.finished and out.finish_reason != "abort":
                    ended = True
                    self.finished[request_id] = out.finish_reason
                yield out
        finally:
            if not ended:
                self.aborted.append(request_id)

    def _step_once(self) -> None:
        eng = self.engine
        if self._held() or (self.no_steps is not None and self.no_steps.is_set()):
            self._drain(block=False)
            self.idle_loops += 1
            time.sleep(0.01)
            return
        if self.step_delay and eng.has_work():
            time.sleep(self.step_delay)
        super()._step_once()

    def hold_steps(self) -> threading.Event:
        """No step runs until the returned event is cleared (the step thread, maybe waiting idle for
        work, is woken and has come round to the check before this returns)."""
        self.no_steps, seen = threading.Event(), self.idle_loops
        self.no_steps.set()
        self._inbox.put(("wake", None))
        while self.idle_loops == seen:
            time.sleep(0.005)
        return self.no_steps

    def _held(self) -> bool:
        """The gate is shut and every sequence has had an output (none waits)."""
        eng = self.engine
        return (self.gate is not None and not self.gate.is_set() and self._closed is None and eng.running
                and not eng.waiting and all(s.output_ids for s in eng.running))
