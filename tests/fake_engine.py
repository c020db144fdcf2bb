"""A deterministic stand-in for specserve.engine.async_engine.AsyncEngine.

Same interface as the real engine (tokenizer, model_name, max_model_len,
spec_enabled, from_args, start, shutdown, generate, abort, stats), but the
"model" emits a scripted text with a char-level tokenizer:

- ``responder(prompt_text, params) -> str`` decides the text (default: SCRIPT);
  the end of the text is EOS (finish "stop") unless ignore_eos, which cycles
  the text until max_tokens (finish "length");
- with speculation on, step s verifies ``num_spec_tokens`` drafts and accepts
  ``accept_pattern[s % len]`` of them, so it yields accepted + 1 tokens;
- stop strings, held-back text and min_tokens / include_stop_str_in_output are the engine's own
  (``engine.detokenizer.StopText``), token by token as the engine adds verified tokens;
  max_tokens gives "length";
- KV "blocks" are taken as the sequence grows and given back when it ends,
  however it ends; aborts are recorded in ``aborted``;
- ``gate`` (a threading.Event): when set to one, every request stops after its first output
  until the gate opens; ``fail_all(exc)`` ends every request (and every later one) with exc.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import threading
from typing import AsyncIterator, Callable

from specserve.engine.detokenizer import StopText
from specserve.engine.types import EngineStats, RequestOutput, SamplingParams, AcceptanceStats, TokenLogprob
from specserve.errors import RequestError

SCRIPT = "Hello there! This is a scripted answer from the fake engine."

# <|role|>content per message; echoes template kwargs so tests can see them
FAKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if greeting is defined %}[greeting={{ greeting }}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)


class CharTokenizer:
    """One token per character; <pad>=0, <s>=1, </s>=2 are special."""

    SPECIALS = ("<pad>", "<s>", "</s>")
    OFFSET = 3

    def __init__(self, chat_template: str | None = FAKE_TEMPLATE):
        self.chat_template = chat_template
        self.bos_token = "<s>"
        self.eos_token = "</s>"
        self.add_bos = True
        self.vocab_size = self.OFFSET + 0x110000
        self.eos_id = 2

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for sid, special in enumerate(self.SPECIALS):
                if text.startswith(special, i):
                    ids.append(sid)
                    i += len(special)
                    break
            else:
                ids.append(ord(text[i]) + self.OFFSET)
                i += 1
        return ([1] + ids) if add_special_tokens and self.add_bos else ids

    def id_to_token(self, i: int) -> str:
        return self.SPECIALS[i] if i < self.OFFSET else chr(i - self.OFFSET)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if (i < self.OFFSET and skip_special_tokens) else self.id_to_token(i) for i in ids)


class FakeEngine:
    def __init__(self, *, model_name: str = "fake-model", chat_template: str | None = FAKE_TEMPLATE,
                 max_model_len: int = 512, spec: bool = True, num_spec_tokens: int = 4,
                 accept_pattern: tuple[int, ...] = (2, 0, 4, 1, 3), step_delay: float = 0.0,
                 kv_blocks: int = 256, block_size: int = 16,
                 responder: Callable[[str, SamplingParams], str] | None = None):
        self.tokenizer = CharTokenizer(chat_template)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.spec_enabled = spec
        self.num_spec_tokens = num_spec_tokens
        self.accept_pattern = accept_pattern
        self.step_delay = step_delay
        self.block_size = block_size
        self.kv_blocks_total = kv_blocks
        self.kv_blocks_free = kv_blocks
        self.responder = responder or (lambda prompt, params: SCRIPT)
        self.fail_next: BaseException | None = None  # raised by the next generate() before its first output
        self.prompts: list[str] = []  # decoded prompts, in arrival order
        self.requests: list[tuple[str, SamplingParams]] = []
        self.aborted: list[str] = []
        self.finished: dict[str, str] = {}
        self.started = False
        self.gate: threading.Event | None = None
        self.failed_with: BaseException | None = None
        self._running: set[str] = set()
        self._abort_flags: set[str] = set()

    @classmethod
    def from_args(cls, args: argparse.Namespace, own_thread: bool = True) -> "FakeEngine":
        return cls(spec=bool(getattr(args, "speculative_config", None)))

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._abort_flags.add(request_id)

    def fail_all(self, exc: BaseException) -> None:
        self.failed_with = exc

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), num_waiting=0, kv_blocks_total=self.kv_blocks_total,
                           kv_blocks_free=self.kv_blocks_free)

    # ------------------------------------------------------------ generation

    def _logprob(self, token_id: int, k: int) -> TokenLogprob:
        lp = -0.25 * (token_id % 4 + 1)
        return TokenLogprob(token_id, lp, [(token_id + j, lp - j) for j in range(k)])

    def _script_ids(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        text = self.responder(self.tokenizer.decode(prompt_ids, skip_special_tokens=False), params)
        ids = self.tokenizer.encode(text)
        if params.ignore_eos:
            ids = (ids or [ord(".") + 3]) * math.ceil(params.max_tokens / max(1, len(ids)))
        return ids

    def _grow(self, held: int, tokens: int) -> int:
        need = math.ceil(tokens / self.block_size)
        take = min(need - held, self.kv_blocks_free)
        self.kv_blocks_free -= take
        return held + take

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str, images: list | None = None) -> AsyncIterator[RequestOutput]:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        if self.failed_with is not None:
            raise self.failed_with
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds "
                               f"max_model_len ({self.max_model_len})", param="max_tokens")
        self.prompts.append(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        self.requests.append((request_id, params))
        self._running.add(request_id)
        held = self._grow(0, len(prompt_ids))
        finished = False
        try:
            async for out in self._steps(prompt_ids, params, request_id):
                held = self._grow(held, len(prompt_ids) + out.completion_tokens)
                finished = out.finished and out.finish_reason != "abort"
                yield out
        finally:
            self._running.discard(request_id)
            self._abort_flags.discard(request_id)
            self.kv_blocks_free += held
            if not finished:
                self.aborted.append(request_id)

    async def _steps(self, prompt_ids, params, request_id) -> AsyncIterator[RequestOutput]:
        script = self._script_ids(prompt_ids, params)
        spec = AcceptanceStats() if self.spec_enabled else None
        out = StopText(params.stop, params.include_stop_str_in_output)
        produced, step = 0, 0
        while True:
            await asyncio.sleep(self.step_delay)
            while (step and self.gate is not None and not self.gate.is_set() and self.failed_with is None
                   and request_id not in self._abort_flags):
                await asyncio.sleep(0.01)
            if self.failed_with is not None:
                raise self.failed_with
            if request_id in self._abort_flags:
                yield self._out(request_id, [], "", None, True, "abort", len(prompt_ids), produced, spec)
                return
            n = 1
            if spec is not None:
                accepted = min(self.accept_pattern[step % len(self.accept_pattern)], self.num_spec_tokens)
                spec.record(self.num_spec_tokens, accepted)
                n = accepted + 1
            new_ids, reason = [], None
            for tok in script[produced:produced + n]:  # as the engine adds verified tokens
                new_ids.append(tok)
                produced += 1
                if out.extend(self.tokenizer.decode([tok]), look=produced >= params.min_tokens):
                    reason = "stop"
                elif produced >= params.max_tokens:
                    reason = "length"
                elif produced >= len(script):
                    reason = "stop"  # EOS
                if reason:
                    break
            step += 1
            new_text = out.delta(final=reason is not None)
            lps = [self._logprob(t, params.logprobs) for t in new_ids] if params.logprobs is not None else None
            yield self._out(request_id, new_ids, new_text, lps, reason is not None, reason, len(prompt_ids),
                            produced, spec)
            if reason is not None:
                self.finished[request_id] = reason
                return

    def _out(self, request_id, ids, text, lps, finished, reason, prompt_tokens, produced, spec) -> RequestOutput:
        snapshot = None
        if spec is not None:
            snapshot = AcceptanceStats(spec.steps, spec.draft_tokens, spec.accepted_tokens, list(spec.accepted_per_pos))
        return RequestOutput(request_id=request_id, new_token_ids=list(ids), new_text=text, new_logprobs=lps,
                             finished=finished, finish_reason=reason, prompt_tokens=prompt_tokens,
                             completion_tokens=produced, cached_tokens=0, acceptance=snapshot,
                             first_token_latency=None, prefill_time=0.001, decode_time=0.001 * max(1, produced))
