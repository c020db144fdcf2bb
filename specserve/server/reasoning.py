"""Split a model's output into reasoning (inside <think>...</think>) and the answer.

One incremental state machine serves both streaming and non-streaming
responses (non-streaming feeds the whole text at once), so both see the same
split. Tags may arrive in pieces: text that could be the start of a tag is
held back until the next delta decides it.

- ``qwen3``: the output is content unless it opens with ``<think>`` or the
  prompt already opened one (the template ended the prompt with ``<think>``).
- ``deepseek_r1``: everything before ``</think>`` is reasoning, with or
  without an opening tag (its template opens the block in the prompt).

A block that is never closed leaves everything in reasoning. Whitespace
around the reasoning and before the answer is trimmed (Qwen writes
``<think>\n...\n</think>\n\n``).
"""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"

# states
_START = "start"  # qwen3, prompt did not open a block: content unless the output opens one
_REASONING_START = "reasoning_start"  # in reasoning; a redundant leading <think> is dropped
_LEAD = "lead"  # reasoning begins: drop whitespace before it
_REASONING = "reasoning"
_AFTER = "after"  # just closed: drop whitespace before the answer
_CONTENT = "content"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    def __init__(self, kind: str, prompt_opened: bool = False):
        if kind not in ("qwen3", "deepseek_r1"):
            raise ValueError(f"unknown reasoning parser {kind!r}")
        self.kind = kind
        self.state = _REASONING_START if (prompt_opened or kind == "deepseek_r1") else _START
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Consume a delta; return (reasoning, content) that can be emitted now."""
        self._buf += text
        reasoning, content = [], []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of output: flush held-back text to where it belongs."""
        buf, self._buf = self._buf, ""
        if self.state == _REASONING:
            return buf, ""  # a piece of "</think>" that never completed
        if self.state in (_REASONING_START, _LEAD, _AFTER):
            return "", ""  # only whitespace or a piece of "<think>" is ever held here
        return "", buf

    # each step consumes from the buffer; returns True to run another step
    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        buf = self._buf
        if not buf:
            return False
        if self.state in (_START, _REASONING_START):
            return self._step_start(buf, reasoning, content)
        if self.state == _REASONING:
            return self._step_reasoning(buf, reasoning)
        if self.state in (_LEAD, _AFTER):
            rest = buf.lstrip()
            self._buf = rest
            if rest:
                self.state = _REASONING if self.state == _LEAD else _CONTENT
            return bool(rest)
        content.append(buf)
        self._buf = ""
        return False

    def _step_start(self, buf: str, reasoning: list[str], content: list[str]) -> bool:
        head = buf.lstrip()
        if head.startswith(OPEN):
            self._buf = head[len(OPEN):]
            self.state = _LEAD
            return True
        if OPEN.startswith(head):
            return False  # empty or a piece of "<think>": wait for more
        self.state = _LEAD if self.state == _REASONING_START else _CONTENT
        return True

    def _step_reasoning(self, buf: str, reasoning: list[str]) -> bool:
        at = buf.find(CLOSE)
        if at >= 0:
            reasoning.append(buf[:at].rstrip())
            self._buf = buf[at + len(CLOSE):]
            self.state = _AFTER
            return True
        # hold back a possible piece of "</think>" and the whitespace before it (dropped if it closes)
        keep = partial_suffix(buf, CLOSE)
        body = buf[:len(buf) - keep]
        keep += len(body) - len(body.rstrip())
        reasoning.append(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False


def missing_think_tokens(kind: str, tokenizer) -> list[str]:
    """The tags a reasoning parser looks for that the model's tokenizer does not have as tokens.
    vLLM's parsers refuse such a model; here the split is by text, so a model that spells the tags
    out still splits (and the server only warns at start-up: most such models write no blocks)."""
    if kind == "none":
        return []
    return [tag for tag in (OPEN, CLOSE) if len(tokenizer.encode(tag)) != 1]


def make_parser(kind: str, prompt_opened: bool) -> ReasoningParser | None:
    return None if kind == "none" else ReasoningParser(kind, prompt_opened)


def split_all(kind: str, prompt_opened: bool, text: str) -> tuple[str | None, str]:
    """Non-streaming split: (reasoning or None, content)."""
    parser = make_parser(kind, prompt_opened)
    if parser is None:
        return None, text
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    reasoning = r1 + r2
    return (reasoning if reasoning else None), c1 + c2
