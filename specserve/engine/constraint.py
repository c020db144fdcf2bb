"""Constrained decoding (structured outputs): which tokens a grammar allows at each row.

A grammar is compiled once per schema (``specserve.server.structured``, which caches it) and
shared by the requests that use it; each sequence then matches it with its own llguidance
matcher. The matcher stands at the sequence's committed tokens plus a stack of tentative ones
(draft tokens): the mask of row j of a verification block is the grammar's state after the
committed tokens and the first j drafts, so the engine asks for the masks of ``[d_1 .. d_k]``,
and the matcher is advanced over the drafts and rolled back to whatever verification keeps.

The same masks serve the drafter (``spec.drafter.pick_tokens``): draft j is picked from the
draft's distribution masked by the state after the earlier drafts, which is the state of
verification row j, so the mask is computed once and cached on the stack. Masking the draft
as well as the target is what keeps rejection sampling exact: a draft sampled from an unmasked
distribution and then cut at its first illegal token is no longer distributed as q
(tests/test_constraint.py shows the bias). A draft that leaves the grammar anyway (an n-gram
drafter's, which has no distribution) is cut before verification (:func:`cut_proposal`).

With a reasoning model the grammar starts only after the reasoning ends: in phase ``think``
every token is allowed until the output's bytes contain ``</think>``; phase ``maybe`` (a qwen3
template that did not open a block) allows the grammar's first tokens or a token that opens one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

log = logging.getLogger("specserve.engine")

THINK_CLOSE = b"</think>"
STARTS = ("now", "after_think", "maybe_think")
_PHASE = {"now": "grammar", "after_think": "think", "maybe_think": "maybe"}
_UNSET = object()


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar: a matcher at its start state, copied by each sequence (never advanced
    itself), and the llguidance tokenizer it was compiled for."""

    matcher: Any  # llguidance.LLMatcher
    tokenizer: Any  # llguidance.LLTokenizer
    description: str = ""  # for logs: what the request asked for


@dataclass(frozen=True)
class ConstraintSpec:
    """What one request is constrained to (carried by ``SamplingParams.structured``)."""

    grammar: Grammar
    start: str = "now"  # "now", "after_think" (after </think>) or "maybe_think" (see the module doc)
    think_open: tuple[int, ...] = ()  # tokens that open a reasoning block (for "maybe_think")

    def __post_init__(self) -> None:
        if self.start not in STARTS:
            raise ValueError(f"unknown constraint start {self.start!r}")


@dataclass
class _Entry:
    """A tentative token on the stack, with what undoing it restores."""

    token: int
    phase: str  # the phase before the token
    tail: bytes  # the reasoning's last bytes before the token
    consumed: bool  # the matcher consumed it (undone by a rollback)
    mask: Any = field(default=_UNSET)  # the mask after the token, once computed


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's int32 bitmask [ceil(vocab / 32)] -> bool [vocab] (True: allowed). Bit i of
    word w is token 32 w + i: little-endian bytes, least significant bit first. (numpy's
    unpackbits: about 100x faster than the same in torch ops on this CPU.)"""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))[:vocab]


class Constraint:
    """One sequence's grammar state: masks for rows after tentative tokens, cuts, commits."""

    def __init__(self, spec: ConstraintSpec):
        self.tokenizer = spec.grammar.tokenizer
        self.matcher = spec.grammar.matcher.deep_copy()
        self.phase = _PHASE[spec.start]
        self.think_open = frozenset(spec.think_open)
        self.eos = frozenset(self.tokenizer.eos_tokens)
        self.tail = b""
        self.stack: list[_Entry] = []
        self.base_mask: Any = _UNSET  # the mask at the committed tokens, once computed
        self.broken = False  # the matcher failed (a resource limit): only an end token is allowed
        self._bits = torch.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    # ---- what the engine and the drafters ask --------------------------------------------
    def mask_after(self, tokens: list[int], width: int) -> torch.Tensor | None:
        """The allowed tokens ([width] bool) after the committed tokens plus ``tokens`` (which
        must be legal: a proposal is cut first); None when every token is allowed (reasoning)."""
        if self._sync(tokens) < len(tokens):
            raise ValueError("mask_after: the tokens leave the grammar (cut the draft first)")
        mask = self._here()
        return None if mask is None else _fit(mask, width)

    def masks(self, drafts: list[int], width: int) -> torch.Tensor | None:
        """Masks of the rows of a verification block over ``drafts``: [len(drafts) + 1, width],
        row j after the first j drafts; None when no row is constrained."""
        if self._sync(drafts) < len(drafts):
            raise ValueError("masks: the drafts leave the grammar (cut the draft first)")
        known = [self.base_mask] + [e.mask for e in self.stack]
        if _UNSET in known:  # back to the first row not yet computed, then forward row by row
            first = known.index(_UNSET)
            self._sync(drafts[:first])
            for tok in drafts[first:]:
                self._here()
                self._push(tok)
            self._here()
        rows = [self.base_mask] + [e.mask for e in self.stack]
        if all(r is None for r in rows):
            return None
        out = np.ones((len(rows), width), dtype=np.bool_)  # numpy: no thread pool for a small copy
        for j, r in enumerate(rows):
            if r is not None:
                out[j] = _fit(r, width).numpy()
        return torch.from_numpy(out)

    def legal_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows (each in its row's mask)."""
        return self._sync(tokens)

    def commit(self, tokens: list[int]) -> None:
        """The sequence appended ``tokens``: they become the committed state."""
        if self._sync(tokens) < len(tokens):  # cannot happen when every row was masked
            log.warning("a committed token leaves the grammar; only an end token is allowed from here")
            self.broken = True
        self.base_mask = self.stack[-1].mask if self.stack else self.base_mask
        if self.broken:
            self.base_mask = _UNSET
        self.stack.clear()

    # ---- the stack -------------------------------------------------------------------------
    def _sync(self, tokens: list[int]) -> int:
        """Make the stack hold ``tokens``' longest legal prefix; returns its length."""
        same = 0
        while same < min(len(tokens), len(self.stack)) and self.stack[same].token == tokens[same]:
            same += 1
        while len(self.stack) > same:
            self._pop()
        for tok in tokens[same:]:
            if not self._push(tok):
                break
        return len(self.stack)

    def _here(self) -> torch.Tensor | None:
        """The mask at the top of the stack (tokenizer-wide), computed once."""
        mask = self.stack[-1].mask if self.stack else self.base_mask
        if mask is _UNSET:
            mask = self._mask_here()
            if self.stack:
                self.stack[-1].mask = mask
            else:
                self.base_mask = mask
        return mask

    def _push(self, tok: int) -> bool:
        """Advance over ``tok`` if the mask here allows it (the mask, not the matcher's own check,
        decides: llguidance's masks allow only the canonical tokens of forced text, its consume
        a few more, and a draft must be legal exactly when its verification row allows it)."""
        phase, tail = self.phase, self.tail
        if phase == "think":
            seen = tail + self.tokenizer.decode_bytes([tok])
            if THINK_CLOSE in seen:
                self.phase, self.tail = "grammar", b""
            else:
                self.tail = seen[-(len(THINK_CLOSE) - 1):]
            self.stack.append(_Entry(tok, phase, tail, False))
            return True
        if phase == "maybe" and tok in self.think_open:
            self.phase = "think"
            self.stack.append(_Entry(tok, phase, tail, False))
            return True
        mask = self._here()
        if not (0 <= tok < mask.shape[0] and mask[tok]):
            return False
        # an end token is not given to the matcher: its rollback does not count one (rolling back
        # 1 after an EOS undoes the token before it), and after it nothing but an end follows
        consumed = not self.broken and tok not in self.eos
        if consumed and self.matcher.try_consume_tokens([tok]) != 1:
            return False
        self.phase = "ended" if tok in self.eos else "grammar"
        self.stack.append(_Entry(tok, phase, tail, consumed))
        return True

    def _pop(self) -> None:
        e = self.stack.pop()
        if e.consumed:
            self.matcher.rollback(1)
        self.phase, self.tail = e.phase, e.tail

    def _mask_here(self) -> torch.Tensor | None:
        if self.phase == "think":
            return None
        vocab = self.tokenizer.vocab_size
        if not self.broken and self.phase != "ended":
            self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
            if self.matcher.is_error():
                log.warning("grammar matcher failed: %s; only an end token is allowed from here",
                            self.matcher.get_error())
                self.broken = True
        if self.broken or self.phase == "ended":
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[sorted(self.eos)] = True
        else:
            mask = unpack_bitmask(self._bits, vocab)
        if self.phase == "maybe" and self.think_open:
            mask = mask.clone()
            mask[list(self.think_open)] = True
        return mask


def _fit(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A tokenizer-sized mask to the logits' width (ids past the tokenizer are never allowed)."""
    if mask.shape[0] == width:
        return mask
    if mask.shape[0] > width:
        return mask[:width]
    return torch.cat([mask, torch.zeros(width - mask.shape[0], dtype=torch.bool)])


def cut_proposal(seq, prop):
    """A proposal cut before its first draft token the sequence's grammar rejects (marked cut,
    so the draft policy counts the position as a rejection); unchanged without a constraint."""
    c = seq.constraint
    if c is None or not prop.token_ids:
        return prop
    n = c.legal_prefix(prop.token_ids)
    if n == len(prop.token_ids):
        return prop
    return replace(prop, token_ids=prop.token_ids[:n], probs=None if prop.probs is None else prop.probs[:n], cut=True)
