"""A frequency-ranked draft vocabulary (as in FR-Spec, Zhao et al. 2025, and EAGLE-3's draft vocab).

A small draft model over a 150K-token vocabulary spends a large share of each step in its LM head
(qwen2.5-coder-0.5b: 136M of its 494M weights). The draft only has to guess the likely tokens, so
its head can be cut to the ``size`` most frequent ones: the drafter then never proposes a token
outside that set, which costs some acceptance, and verification by the full target keeps the output
exactly what it was. With temperature > 0 the draft distribution is zero outside the set, which
rejection sampling handles exactly (the residual supplies those tokens).

Frequencies are counted once per tokenizer over a fixed slice of the Python standard library's
source (code, comments, docstrings: a corpus every Python install has, and not the benchmark
prompts) and cached under the user cache. Tokens never seen there follow in id order (BPE merge
order, itself roughly by frequency). Special tokens (EOS and the chat template's) are always in.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

from specserve.errors import SpecserveError
from specserve.models.tokenizer import Tokenizer
from specserve.models.transformer import Transformer

CORPUS_BYTES = 4 << 20  # about 1M tokens of standard-library source
CHUNK = 64 << 10


def _corpus() -> list[str]:
    """Texts of the standard library's .py files in sorted path order, up to CORPUS_BYTES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for i in range(0, len(text), CHUNK):
            texts.append(text[i:i + CHUNK])
        total += len(text)
        if total >= CORPUS_BYTES:
            break
    return texts


def _key(tok: Tokenizer) -> str:
    h = hashlib.sha256("\x00".join(tok.vocab_fingerprint()).encode())
    h.update(str(CORPUS_BYTES).encode())
    return h.hexdigest()[:16]


def token_counts(tok: Tokenizer, cache_dir: Path) -> torch.Tensor:
    """[V] int64: occurrences of each token id in the corpus (cached per tokenizer)."""
    path = cache_dir / "draft_vocab" / f"{_key(tok)}.pt"
    if path.exists():
        try:
            counts = torch.load(path, weights_only=True)  # tensors only: never unpickle code
            if counts.shape == (tok.vocab_size,):
                return counts
        except Exception:  # a corrupt cache entry is recounted
            pass
    counts = torch.zeros(tok.vocab_size, dtype=torch.int64)
    for enc in tok.backend.encode_batch(_corpus(), add_special_tokens=False):
        ids = torch.tensor(enc.ids, dtype=torch.int64)
        counts += torch.bincount(ids[ids < tok.vocab_size], minlength=tok.vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(counts, tmp)
    tmp.replace(path)
    return counts


def head_cut(size: int | None, vocab: int) -> int | None:
    """The speculative config's ``draft_vocab_size`` checked against the LM head it cuts:
    None for the full head (no size, or exactly the vocabulary); a size above the vocabulary
    is an error, not a silent full head."""
    if size and size > vocab:
        raise SpecserveError(f"speculative config: draft_vocab_size {size} is larger than the vocabulary "
                             f"the drafts come from ({vocab} tokens)")
    return size if size and size < vocab else None


def frequent_ids(tok: Tokenizer, size: int, cache_dir: Path, counts: torch.Tensor | None = None) -> torch.Tensor:
    """[size] int64, ascending: the draft vocabulary (all ids when size >= the vocabulary).

    counts: [V] token counts to rank by (default: the standard-library corpus, ``token_counts``)."""
    vocab = tok.vocab_size
    if size >= vocab:
        return torch.arange(vocab, dtype=torch.int64)
    counts = (token_counts(tok, cache_dir) if counts is None else counts[:vocab].to(torch.int64)).clone()
    special = set(tok.eos_token_ids) | set(tok.backend.get_added_tokens_decoder())
    if tok.bos_token_id is not None:
        special.add(tok.bos_token_id)
    special_ids = torch.tensor(sorted(i for i in special if i < vocab), dtype=torch.int64)
    counts[special_ids] = counts.max() + 1
    order = torch.sort(-counts, stable=True).indices  # by count, ties by id
    return torch.sort(order[:size]).values


def cut_vocab(model: Transformer, tok: Tokenizer, size: int | None, counts: torch.Tensor | None = None
              ) -> "DraftVocab | None":
    """The draft vocabulary of ``size`` tokens (``draft_vocab_size``, checked by ``head_cut``)
    over ``model``'s LM head, ranked by ``counts`` (default: the standard-library corpus); None:
    the full head."""
    from specserve.models.catalog import cache_root

    size = head_cut(size, model.head_size)
    return DraftVocab(model, frequent_ids(tok, size, cache_root(), counts)) if size else None


class DraftVocab:
    """A draft model's LM head cut to a token subset, which grows with the tokens requests use.

    Starts from ``ids`` (``frequent_ids``); tokens of prompts and verified outputs that are not in
    the set are added (``add``) and get logits from a small second head, rebuilt from the full
    head's rows before the next draft step. Row subsets are copies of the stored rows, so every
    kept logit is bit-identical to the full head's.
    """

    def __init__(self, model: Transformer, ids: torch.Tensor):
        self.model = model
        self.vocab = model.head_size
        self.member = torch.zeros(self.vocab, dtype=torch.bool)  # [V]
        self.member[ids] = True
        self.ids = [ids]  # ids of each head, in order: [n_0], [n_1], ...
        self.heads = [model.cut_head(ids)]  # (tensor parallel: each rank's rows of them)
        self.pending: set[int] = set()

    @property
    def size(self) -> int:
        return int(self.member.sum())

    def add(self, tokens: list[int]) -> None:
        """Tokens a request uses; the ones outside the set join it before the next step."""
        if tokens:
            t = torch.tensor(tokens, dtype=torch.int64)
            self.pending.update(t[~self.member[t]].tolist())

    def _refresh(self) -> None:
        if not self.pending:
            return
        new = torch.tensor(sorted(self.pending), dtype=torch.int64)
        self.pending.clear()
        self.member[new] = True
        extra = new if len(self.ids) == 1 else torch.cat([self.ids[1], new])
        head = self.model.cut_head(extra, replaces=self.heads[1] if len(self.heads) > 1 else None)
        self.ids[1:], self.heads[1:] = [extra], [head]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [L, H] after the final norm -> [L, V] float32, -inf outside the set."""
        self._refresh()
        out = torch.full((h.shape[0], self.vocab), float("-inf"), dtype=torch.float32, device=h.device)
        for ids, head in zip(self.ids, self.heads):
            out[:, ids.to(h.device)] = self.model.logits(h, head)
        return out
