"""A separate small model with the same tokenizer, drafting k tokens autoregressively.

It keeps its own paged KV cache, managed by a cache coordinator of its own over the draft
model's layer cache specs (the engine's machinery, engine/cache/). Per sequence it tracks how
many of the sequence's tokens its cache holds; after verification the rejected draft positions
are released by bookkeeping (the count goes back, surplus blocks return to the pool), never by
copying.
With prefix caching on, its cache is reused in step with the target's: full blocks of verified
tokens are registered under the same chained hash (salted with the draft model's identity), and
a new sequence starts from the longest cached prefix instead of re-running the draft model on it.

Each forward also reads up to ``draft_lookup_tokens`` tokens that prompt lookup expects next (the
sequence's last tokens matched earlier in its context): the draft picks its next token from the
first row as always, and while the token picked equals the guess whose row comes next, that row's
logits give the following token without another forward. The drafts are the draft model's own;
the K/V rows of guesses past the first wrong one are given back by bookkeeping.

A draft model far behind a sequence (a long prompt, or many steps another drafter of a chain
drafted) does not read all it missed: past ``draft_window`` unread tokens it drops what its cache
holds and reads the sequence's first ``SINK_TOKENS`` tokens and its last ``draft_window`` ones, at
positions numbered on from the first (the sequence's middle is skipped, as StreamingLLM keeps its
attention sinks and a recent window). Its cache then holds its own view of the sequence, which is
what its prefix-cache blocks are hashed by. Only the drafts change: verification keeps the output
the target's.

A view's skip (the middle left out) sits on a grid of a quarter window, and a slide takes, of the
grid's skips that leave between ``window`` and twice that many tokens after the sink, the one that
leaves the least to read past what the prefix cache holds of its view (the latest, where none
holds more than the sink). So the next turn of a long conversation (the last prompt, its answer
and a new message) finds the view the last turn's draft read and wrote on, and reads only what is
new, until the view would pass twice the window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.cache import CacheCoordinator, SequenceCache, layer_cache_specs
from specserve.engine.config import EngineConfig, kv_bytes_per_token
from specserve.engine.sequence import Sequence
from specserve.errors import SpecserveError
from specserve.models.loader import LoadedModel, LoadOptions, load_model
from specserve.engine.model_runner import BatchEntry, build_forward_batch
from specserve.models.transformer import KVCache
from specserve.speculative.adaptive import CostModel
from specserve.speculative.config import DEFAULT_DRAFT_LOOKUP, DEFAULT_DRAFT_WINDOW, SpeculativeConfig
from specserve.speculative.draft_vocab import DraftVocab, cut_vocab
from specserve.speculative.drafter import Drafter, Proposal, pick_tokens
from specserve.speculative.ngram import find_continuation

DRAFT_POOL_CAP = 1 << 30
LOOKUP_WINDOW = 4096  # tokens of context prompt lookup searches for the draft's guesses
SINK_TOKENS = 16  # a windowed draft's view starts with the sequence's first tokens


@dataclass
class _State:
    """A sequence as the draft model's cache coordinator sees it."""

    cache: SequenceCache = field(default_factory=SequenceCache)  # its tables in the draft's groups
    cache_keys: list[int] = field(default_factory=list)  # the tokens a commit / prefix match hashes
    num_computed: int = 0  # tokens of the draft's view of the sequence (plus drafts) whose K/V this cache holds
    skip: int = 0  # sequence tokens after the first SINK_TOKENS that the view leaves out (a window)
    base: int = 0  # sequence length when the last proposal was made
    drafts: list[int] = field(default_factory=list)  # the last proposal
    num_cached: int = 0  # tokens served by the prefix cache when the sequence started
    generator: torch.Generator | None = None
    plan: tuple[int, int, int] = (-1, 0, 0)  # the next slide (sequence length, skip, cached tokens of its view)

CATCH_UP_ROWS = 512  # warm_up's wide forward (the draft reading a prompt): wide enough that attention shows


def wide_time(points: list[tuple[int, float]], n: int) -> float:
    """Seconds of an n-row forward from two or more measured (rows, seconds) points sorted by rows, the
    first at or under n: linear between the two around n; past them along the widest two (never below
    the widest one's time), bending up with the parabola through the widest three where it does (a
    prompt read from its start: each row attends all rows before it, so attention grows as n^2)."""
    above = [pt for pt in points if pt[0] > n]
    if above:
        (r0, t0), (r1, t1) = [pt for pt in points if pt[0] <= n][-1], above[0]
        return t0 + (t1 - t0) * (n - r0) / (r1 - r0)
    (r0, t0), (r1, t1) = points[-2], points[-1]
    slope = (t1 - t0) / (r1 - r0)
    bend = 0.0
    if len(points) >= 3:  # the second divided difference of the widest three
        ra, ta = points[-3]
        bend = max((slope - (t0 - ta) / (r0 - ra)) / (r1 - ra), 0.0)
    return max(t1 + slope * (n - r1) + bend * (n - r1) * (n - r0), t1)


class DraftModelDrafter(Drafter):
    name = "draft_model"
    has_cost = True

    def __init__(self, draft: LoadedModel, num_blocks: int, block_size: int, max_model_len: int,
                 prefix_caching: bool = True, vocab: DraftVocab | None = None, p_min: float = 0.0,
                 lookup: int = 0, lookup_min: int = 2, lookup_max: int = 5, window: int = DEFAULT_DRAFT_WINDOW):
        self.draft = draft
        self.p_min = p_min  # stop a sequence's draft at a token the draft gives less probability
        self.model = draft.model
        self.vocab = vocab  # None: the full LM head
        self.kv = KVCache.allocate(draft.config, num_blocks, block_size, self.model.dtype, self.model.device)
        specs = layer_cache_specs(draft.config, block_size, kv_bytes_per_token(draft.config, self.model.dtype, 1),
                                  window_paged=False)  # one pool (a sliding layer's window: in the kernel)
        if len(specs) != 1:
            raise SpecserveError(f"draft model {draft.name}: only attention-only models can draft (its layers "
                                 f"keep {', '.join(sp.kind for sp in specs)})")
        self.cache = CacheCoordinator.build(specs, (num_blocks,), prefix_caching, salt=draft.identity)
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size) + 2
        self.cost = CostModel()  # seconds per draft forward, by width
        # forwards wider than the cost table's (a prompt read at once), the latest per power of two of
        # their rows: (rows, seconds), a bounded record for catch_up_cost
        self.wide: dict[int, tuple[int, float]] = {}
        self.lookup, self.lookup_min, self.lookup_max = lookup, lookup_min, lookup_max
        self.window = window  # 0: a draft model behind reads all it missed
        self.forwards_per_token = 1.0  # running means: a sequence's draft forwards per drafted token,
        self.width = 1.0  # and its rows in each (its next token and the guesses)
        self.num_forwards = self.num_drafted = 0  # totals: a sequence's forwards, the tokens they drafted

    @classmethod
    def build(cls, spec: SpeculativeConfig, target: LoadedModel, options: LoadOptions, ecfg: EngineConfig,
              max_model_len: int) -> "DraftModelDrafter":
        opts = LoadOptions(options.device, options.dtype, spec.quantization or options.quantization)
        draft = load_model(spec.model, opts)
        check_same_vocab(target, draft)
        per_token = kv_bytes_per_token(draft.config, draft.model.dtype)
        want = ecfg.max_num_seqs * (max_model_len + 2 * ecfg.block_size) * per_token
        num_blocks = max(min(want, DRAFT_POOL_CAP) // (ecfg.block_size * per_token),
                         -(-max_model_len // ecfg.block_size) + 2)
        vocab = cut_vocab(draft.model, draft.tokenizer, spec.draft_vocab_size)
        lookup = DEFAULT_DRAFT_LOOKUP if spec.draft_lookup_tokens is None else spec.draft_lookup_tokens
        window = DEFAULT_DRAFT_WINDOW if spec.draft_window is None else spec.draft_window
        return cls(draft, int(num_blocks), ecfg.block_size, max_model_len, ecfg.enable_prefix_caching, vocab,
                   spec.draft_p_min, lookup, spec.prompt_lookup_min, spec.prompt_lookup_max, window)

    @property
    def blocks(self) -> BlockManager:
        """The draft's block pool (the coordinator's growing group)."""
        return self.cache.main.pool

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def kv_bytes(self) -> int:
        return self.kv.nbytes()

    def _state(self, seq: Sequence) -> _State:
        st = seq.drafter_state.get(self.name)
        if st is None:
            st = self.seq_state(seq, _State)
            st.cache_keys = seq.token_ids
            st.num_computed = st.num_cached = self.cache.match_prefix(st)
        return st

    @staticmethod
    def _view(skip: int, tokens: list[int], start: int = 0) -> list[int]:
        """The draft's view of a sequence's tokens with ``skip`` of them left out after the first
        SINK_TOKENS (0: all of them) from its position ``start`` on, without building the part before."""
        if not skip or start >= SINK_TOKENS:
            return tokens[start + skip:]
        return tokens[start:SINK_TOKENS] + tokens[SINK_TOKENS + skip:]

    def _behind(self, seq: Sequence, st: _State) -> int:  # sequence tokens past the view's computed ones
        return seq.num_tokens - st.skip - st.num_computed

    def _slides(self, seq: Sequence, st: _State) -> bool:
        """Whether the next proposal slides the view (too far behind to read all it missed)."""
        return bool(self.window) and self._behind(seq, st) > SINK_TOKENS + self.window

    def _plan(self, seq: Sequence, st: _State) -> tuple[int, int]:
        """(skip, tokens of its view the prefix cache holds) for a slide now: of the skips on the
        grid leaving window .. 2 * window tokens after the sink, the one leaving the least to read,
        the latest among equals (module docstring). Kept until the sequence grows."""
        n = seq.num_tokens
        if st.plan[0] != n:
            grid = max(self.window // 4 // self.block_size, 1) * self.block_size
            last = (n - SINK_TOKENS - self.window) // grid * grid
            best = None  # (tokens to read, skip, cached)
            for skip in range(last, max(n - SINK_TOKENS - 2 * self.window, 0) - 1, -grid):
                cached = self.blocks.cached_prefix(self._view(skip, seq.token_ids))
                if best is None or n - skip - cached < best[0]:
                    best = (n - skip - cached, skip, cached)
            st.plan = (n, best[1], best[2])
        return st.plan[1], st.plan[2]

    def _slide(self, seq: Sequence, st: _State) -> None:
        """Too far behind: drop the cache and view the first tokens and the last ``window`` or more
        (``_plan``; from the prefix cache where an earlier view was the same)."""
        skip, _ = self._plan(seq, st)
        self.cache.free(st)
        st.skip = skip
        st.cache_keys = self._view(skip, seq.token_ids)
        st.num_computed = self.cache.match_prefix(st)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        active = [(s, k) for s, k in zip(seqs, num_tokens) if k > 0]
        drafts: dict[int, list[int]] = {id(s): [] for s, _ in active}
        probs: dict[int, list[torch.Tensor]] = {id(s): [] for s, _ in active}
        for s, _ in active:
            st = self._state(s)
            if self._slides(s, st):
                self._slide(s, st)
            if self.vocab is not None:  # tokens since the last proposal (the prompt, at first)
                self.vocab.add(s.token_ids[st.base:])
            st.base = s.num_tokens
        active_all, cut, forwards, guessed = list(active), set(), 0, 0
        while active:
            rows = []
            for s, k in active:
                context, st = s.token_ids + drafts[id(s)], self._state(s)
                rows.append((s, self._view(st.skip, context, st.num_computed),
                             self._guesses(context, k - len(drafts[id(s)]))))
            logits = self._forward(rows)
            forwards += len(rows)
            guessed += sum(len(g) for _, _, g in rows)
            still = []
            for (s, k), (_, _, guesses), lg in zip(active, rows, logits):
                sure, matched = self._pick_run(s, lg, guesses, drafts[id(s)], probs[id(s)], k)
                self._state(s).num_computed -= len(guesses) - matched  # K/V past a wrong guess: not the draft's
                if not sure:
                    cut.add(id(s))
                elif len(drafts[id(s)]) < k:
                    still.append((s, k))
            active = still
        drafted = sum(len(drafts[id(s)]) for s, _ in active_all)
        self.num_forwards, self.num_drafted = self.num_forwards + forwards, self.num_drafted + drafted
        if drafted:  # running means, for draft_cost
            self.forwards_per_token += 0.1 * (forwards / drafted - self.forwards_per_token)
            self.width += 0.1 * (1 + guessed / forwards - self.width)
        for s, _ in active_all:
            self._state(s).drafts = drafts[id(s)]
        return [Proposal(drafts.get(id(s), []), torch.stack(probs[id(s)]) if probs.get(id(s)) else None,
                         cut=id(s) in cut) for s in seqs]

    def _guesses(self, context: list[int], need: int) -> list[int]:
        """Up to lookup tokens that prompt lookup expects after ``context``: the draft model checks
        them in the same forward as its next token (every one it agrees with saves a forward)."""
        if not self.lookup or need < 2:
            return []
        return find_continuation(context[-LOOKUP_WINDOW:], self.lookup_min, self.lookup_max,
                                 min(self.lookup, need - 1))

    def _pick_run(self, seq: Sequence, logits: torch.Tensor, guesses: list[int], drafts: list[int],
                  probs: list[torch.Tensor], k: int) -> tuple[bool, int]:
        """logits: [1 + len(guesses), V], row j after the first j guesses -> drafts picked row by
        row while each one equals the guess whose row comes next. Returns (sure, guesses matched):
        False when the draft stopped at an unsure token (p_min)."""
        j = 0
        while True:
            if not self._pick(seq, logits[j:j + 1], drafts, probs):
                return False, j
            if len(drafts) >= k or j == len(guesses) or drafts[-1] != guesses[j]:
                return True, j
            j += 1

    def _pick(self, seq: Sequence, logits: torch.Tensor, drafts: list[int], probs: list[torch.Tensor]) -> bool:
        """logits: [1, V] -> append the next draft token (and its distribution when sampling);
        False, appending nothing, when the draft is unsure (p_min, see pick_tokens)."""
        prop = pick_tokens(seq, logits, self._state(seq).generator, earlier=drafts, p_min=self.p_min)
        drafts += prop.token_ids
        if prop.probs is not None:
            probs.append(prop.probs[0])
        return bool(prop.token_ids)

    def _forward(self, rows: list[tuple[Sequence, list[int], list[int]]]) -> list[torch.Tensor]:
        """Run the draft model over each sequence's pending tokens and guesses; per sequence the
        logits [1 + guesses, V] of its last pending row and of each guess."""
        entries, wanted, spans, n = [], [], [], 0
        for seq, toks, guesses in rows:
            st = self._state(seq)
            toks = toks + guesses
            self.cache.reserve(st, st.num_computed + len(toks))
            entries.append(BatchEntry(toks, st.num_computed, self.cache.block_tables(st)))
            st.num_computed += len(toks)
            n += len(toks)
            spans.append((len(wanted), len(guesses) + 1))
            wanted += range(n - len(guesses) - 1, n)
        # a draft vocabulary: logits from its own heads
        batch = build_forward_batch(entries, self.block_size, self.max_blocks, [] if self.vocab is not None else wanted,
                                    self.model.device)
        t0 = time.perf_counter()
        out = self.model.forward(batch, self.kv)
        logits = out.logits if self.vocab is None else self.vocab.logits(out.final_hidden[wanted])
        rows, seconds = int(batch.input_ids.shape[0]), time.perf_counter() - t0
        self.cost.add(rows, seconds)
        if rows > self.cost.max_width:
            self.wide[rows.bit_length()] = (rows, seconds)
        return [logits[i:i + m] for i, m in spans]

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        st = seq.drafter_state.get(self.name)
        if st is None:
            return
        if st.drafts:  # without drafts (none asked this step, e.g. another drafter of a chain proposed) the
            # cache holds verified tokens only, and a roll-back to the last proposal's base would drop some
            st.num_computed = min(st.num_computed, st.base - st.skip + num_accepted)
            self.cache.rollback(st)
        # every position left is a verified token: the sequence so far plus the accepted drafts
        st.cache_keys = self._view(st.skip, seq.token_ids + st.drafts[:num_accepted])
        self.cache.commit(st)
        st.drafts = []

    def on_finished(self, seq: Sequence) -> None:
        st = seq.drafter_state.pop(self.name, None)
        if st is not None:
            self.cache.free(st)

    def warm_up(self, make_seq) -> None:
        for _ in range(3):  # the first forward catches up on the scratch prompt, the rest are single tokens
            seq = make_seq()
            self.propose([seq], [3])
            self.on_finished(seq)
        most = (self.max_blocks - 2) * self.block_size - 8  # (a short max_model_len)
        # one wide forward: what reading a prompt costs per row; a second twice as wide where a catch-up
        # can be much wider (no window, or a wide one): how that cost grows (wide_time)
        far = self.window == 0 or self.window + SINK_TOKENS > 2 * CATCH_UP_ROWS
        for rows in sorted({min(CATCH_UP_ROWS, most), min(2 * CATCH_UP_ROWS if far else CATCH_UP_ROWS, most)}):
            seq = make_seq(rows)
            self.propose([seq], [1])
            self.on_finished(seq)

    def draft_cost(self, k: int) -> float:
        # a forward a token, fewer when the guesses of prompt lookup save some (each a little wider);
        # one token is one forward of one row
        if k <= 1:
            return self.cost.time(1) * k
        return self.cost.time(round(self.width)) * max(1.0, k * self.forwards_per_token)

    def catch_up_cost(self, n: int) -> float:
        # its KV is filled lazily: a proposal after n tokens it has not read starts with an n-row
        # forward where one row would do; past the cost table's widths, from the wide forwards
        # measured (CATCH_UP_ROWS among them since warm_up) and the one-row time
        if n <= 1:
            return 0.0
        one = self.cost.time(1)
        if n <= self.cost.max_width or not self.wide:
            return max(self.cost.time(n) - one, 0.0)
        return max(wide_time([(1, one)] + sorted(self.wide.values()), n) - one, 0.0)

    def unread(self, seq: Sequence) -> int:
        st = self._state(seq)
        if not self._slides(seq, st):
            return self._behind(seq, st)
        skip, cached = self._plan(seq, st)  # what the slide will read
        return seq.num_tokens - skip - cached


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Drafts are token ids: both models must mean the same thing by each id."""
    a, b = target.tokenizer, draft.tokenizer
    if a.vocab_size != b.vocab_size or a.vocab_fingerprint() != b.vocab_fingerprint():
        raise SpecserveError(f"draft model {draft.name} does not share the tokenizer of {target.name} "
                             f"(vocabularies of {b.vocab_size} and {a.vocab_size} tokens differ)")
