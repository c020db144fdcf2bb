"""Adaptive draft length: choose each sequence's k from acceptance and measured cost.

Cost model: the time of a forward pass over w tokens, per width, measured at start-up for the
verification widths and kept up to date online (``CostModel``), plus the drafter's own cost for k
tokens (``Drafter.draft_cost``, and ``Drafter.catch_up_cost`` for the tokens a probe's drafter
has not read yet). A sequence whose drafts are accepted with per-token probability p
yields on average 1 + p + ... + p^k tokens for k drafts. Starting from k = 0 everywhere, drafts
are added one at a time to the sequence with the best marginal gain p_i^(k_i+1), up to every cap,
and the point of that path with the most expected tokens per second is chosen. On text where
drafts are rarely accepted this settles at k = 0, so speculation never makes decode slower by much.

A new sequence's estimate starts from the policy's prior: a slow running acceptance over every
sequence's steps (0.5 before any), so once a drafter has shown it is usually right (a draft
model on code), a new request drafts from its first step instead of earning it from 0.5 with
probes that a costly drafter can afford only rarely. Until PRIOR_EVIDENCE steps have brought
news the prior is the plain mean of their shares, and a sequence the estimate puts at k = 0
drafts one token anyway: else whether an engine ever learned that its drafter is good hung on
its start-up timing (a 0.5 prior chose k = 0 against one calibration and k = 5 against another,
and the engine that chose k = 0 stayed at plain speed through twelve requests where the other
ran at 1.7x: a draft model's probes come too seldom to lift the prior).

A few rejected drafts in a row (digits in a math answer) put a sequence at k = 0, where it gets no
news, and a draft model's probes are rare (each first reads the tokens skipped since): without
more, the sequence stayed at k = 0 for the rest of its answer, a hundred steps of text its drafter
would have guessed. So each sequence also keeps a slow estimate (``accept_slow``, its acceptance
over many steps), and a step without news moves the fast one IDLE_REVERT of the way back up to
it: a sequence whose drafter is usually right drafts again within a few steps; one whose drafter
is usually wrong has a low slow estimate too and stays at k = 0. A drafter that declines to guess at
all (a draft cut to nothing by draft_p_min) brings the slow estimate down to the fast one at once:
else, with cheap drafts, the drift kept asking an always-unsure drafter every few steps.

Each width's time is refreshed only by passes of that width, and a drafting engine seldom runs
its plain width (one row, for one sequence): that time stayed at its start-up measurement, taken
before the prefetch hint was chosen and under whatever else the machine was doing then (28.4 ms,
where plain decode then took 20.3 ms a token), so every step over-valued drafting. A
step that would draft therefore decodes plain once that width was last timed ``every`` passes ago
(``_cost_probe_due``), with ``every`` set so that these cost probes lose at most COST_PROBE_BUDGET.

A draft model reads a sequence lazily: its first proposal is one forward over the prompt (over at
most a window of it, draft_model.py). A sequence drafts only where that catch-up can be repaid
within the tokens it may still make (``_pays_back``): after a 1,700-token prompt read whole, a
128-token answer lost 23% of its decode speed to it. What it may still make is its budget where
nothing else is known; a chat request without max_tokens has the rest of the context as budget
(thousands of tokens), so every long prompt looked worth a catch-up. Once answers have finished,
their lengths say how many tokens may follow, and whether to pay the catch-up now or decode plain
until the answer has outrun the short ones (``AnswerLengths``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

import numpy as np

from specserve.engine.sequence import Sequence

PROBE_EVERY = 8  # a sequence at k = 0 still drafts 1 token every so often, to keep learning
PROBE_MAX = 256  # ... at least this often
PROBE_BUDGET = 0.03  # ... and a drafter with a cost of its own probes at most ~3% of decode time
COST_PROBE_BUDGET = 0.01  # a drafting sequence decodes plain now and then to re-time the plain width, within ~1%
COST_PROBE_MIN, COST_PROBE_MAX = 16, 256  # ... every this many timed passes at most / at least
PRIOR_ALPHA = 0.05  # running acceptance over every sequence's steps: where a new sequence starts
PRIOR_EVIDENCE = 16  # until this many steps brought news, a sequence at k = 0 drafts one token anyway
SLOW_ALPHA = 0.05  # a sequence's slow estimate (accept_slow)
IDLE_REVERT = 0.1  # a step without news moves the estimate this share of the way up to the slow one
ANSWERS_KEPT = 64  # finished answers whose lengths say how long a new one may run (AnswerLengths)


class CostModel:
    """Seconds of one forward pass as a function of its width (tokens in the pass).

    Each width seen keeps a running average; a width not seen yet is interpolated between its
    known neighbours, or extrapolated from the widest two (never below a narrower width's time).
    Passes wider than ``max_width`` (prefill chunks) are left out: their cost per token says
    nothing about a verification block's. Before anything is measured, ``a + b * width``.

    Passes added with ``keys`` (the attention work: key rows attended, summed over the pass's
    rows) also feed ``passes``, a fit over passes of every width and context
    (:class:`PassFit`) that the scheduler's step budget asks (specserve/engine/step_budget.py).

    ``age(width)``: timed passes since that width was last measured. A width the engine stops
    running keeps the conditions it was measured under (the prefetch hint before the engine chose
    one, a neighbour's memory traffic: qwen2.5-coder-1.5b's start-up one-row time was 18-27 ms
    across 20 fresh engines on one machine, and slower than six rows in two), so the policy
    re-times the plain width of a drafting engine now and then (``DraftPolicy``'s cost probes).
    The other way round, an engine decoding plain re-times one row only: after a long prompt one
    row's time grows with the context while the verification widths keep their start-up times,
    taken at a short one, and drafting looked cheap (a 64-token answer to a 1,548-token prompt began
    drafting partway in, reading ~530 tokens of the prompt into the draft first). So a width
    measured before the latest one-row time is scaled by how that time moved since (``ref``): it
    follows the plain width until it is measured again.
    """

    def __init__(self, max_width: int = 64, alpha: float = 0.25, a: float = 0.01, b: float = 0.001):
        self.max_width, self.alpha = max_width, alpha
        self.a, self.b = a, b
        self.table: dict[int, float] = {}  # width -> running average seconds
        self.stamp: dict[int, int] = {}  # width -> the count of timed passes when it was last measured
        self.ref: dict[int, float] = {}  # width -> the one-row time when it was last measured
        self.timed = 0  # passes of a width the table keeps, timed so far
        self.passes = PassFit()

    def add(self, width: int, seconds: float, keys: int | None = None) -> None:
        if keys is not None:
            self.passes.add(width, keys, seconds)
        if not 1 <= width <= self.max_width:
            return
        old = self.table.get(width)
        self.table[width] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        self.timed += 1
        self.stamp[width] = self.timed
        if 1 in self.table:
            self.ref[width] = self.table[1]

    def age(self, width: int) -> int | None:
        """Timed passes since ``width`` was last measured (0: the latest), None if never."""
        stamp = self.stamp.get(width)
        return None if stamp is None else self.timed - stamp

    def _now(self, width: int) -> float:
        """A measured width's time, scaled by how the one-row time moved since (class docstring)."""
        t, ref = self.table[width], self.ref.get(width)
        if width == 1 or not ref or self.stamp.get(1, 0) <= self.stamp[width]:
            return t
        return t * self.table[1] / ref

    def time(self, width: int) -> float:
        if width in self.table:
            return self._now(width)
        known = sorted(self.table)
        if not known:
            return self.a + self.b * width
        below = [w for w in known if w < width]
        above = [w for w in known if w > width]
        if below and above:
            w0, w1 = below[-1], above[0]
            t0, t1 = self._now(w0), self._now(w1)
            return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
        if above:  # narrower than anything measured: the narrowest time
            return self._now(above[0])
        w1 = below[-1]
        slope = self.b if len(below) < 2 else max((self._now(w1) - self._now(below[-2])) / (w1 - below[-2]), 0.0)
        return self._now(w1) + slope * (width - w1)


class PassFit:
    """Seconds of a forward pass of ``rows`` rows attending ``keys`` key rows in all (each row
    attends its position + 1 keys): ``a + b * rows + c * keys``, fitted to measured passes.

    The weights cost the same per row wherever a row sits; attention grows with its context,
    so a prefill chunk late in a long prompt costs more per token than an early one (at 8K
    tokens of context attention dominates). ``keys`` is that context, as a feature. Passes are
    grouped by the powers of two of (rows, keys); a group keeps its last PER_GROUP times and
    counts with their median (a spike of a shared machine moves nothing), at the mean of its
    features. The fit minimizes relative error over the groups (a 5 ms decode step and a 200 ms
    chunk count alike), with every coefficient >= 0 (a cost cannot shrink with more work), so
    ``time`` never falls as rows or keys grow. Groups keep their latest times, so the fit
    follows the machine getting busier or quieter as soon as passes of each kind are run again,
    and a kind not run for a while (long prompts) is still known.

    ``widest`` and ``most_keys`` are the largest passes measured: a caller that extrapolates
    far beyond them should not trust the fit (the step budget grows its passes step by step).
    """

    PER_GROUP = 8
    PRIOR = (0.005, 2e-3, 3e-7)  # seconds, seconds per row, seconds per key: until a fit exists

    def __init__(self):
        self.groups: dict[tuple[int, int], deque] = {}
        self._points: dict[tuple[int, int], tuple[float, float, float, float]] = {}  # a group's summary
        self.widest = 0
        self.most_keys = 0
        self._coef: tuple[float, float, float] | None = None

    def add(self, rows: int, keys: int, seconds: float) -> None:
        if rows < 1 or seconds <= 0:
            return
        key = (rows.bit_length(), keys.bit_length())
        group = self.groups.setdefault(key, deque(maxlen=self.PER_GROUP))
        group.append((rows, keys, seconds))
        self._points[key] = (1.0, sum(r for r, _, _ in group) / len(group), sum(k for _, k, _ in group) / len(group),
                             statistics.median(t for _, _, t in group))
        self.widest, self.most_keys = max(self.widest, rows), max(self.most_keys, keys)
        self._coef = None

    def time(self, rows: int, keys: int) -> float:
        a, b, c = self.coef()
        return a + b * rows + c * keys

    def coef(self) -> tuple[float, float, float]:
        if self._coef is None:
            self._coef = self._fit() if len(self.groups) >= 2 else self.PRIOR
        return self._coef

    def _fit(self) -> tuple[float, float, float]:
        pts = np.array(list(self._points.values()))
        x, y = pts[:, :3], pts[:, 3]
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # columns of one magnitude
        xw, yw = x / scale / y[:, None], np.ones_like(y)  # relative error: divide each row by its time
        best, best_err = None, math.inf
        for mask in range(1, 8):  # non-negative least squares by trying every set of free coefficients
            cols = [j for j in range(3) if mask >> j & 1]
            sol = np.linalg.lstsq(xw[:, cols], yw, rcond=None)[0]
            if (sol < 0).any():
                continue
            theta = np.zeros(3)
            theta[cols] = sol
            err = float(((xw @ theta - yw) ** 2).sum())
            if err < best_err:
                best, best_err = theta, err
        if best is None:
            return self.PRIOR
        a, b, c = (best / scale).tolist()
        return a, b, c


class AnswerLengths:
    """The lengths of the last ``keep`` finished answers, and from them whether a sequence that has
    made ``made`` tokens (at most ``left`` more) should pay a catch-up now (``draft_now``).

    Each answer seen that ran past ``made`` stands for what this one may still make (capped at
    ``left``). Paying ``cost`` now earns ``saving`` a token over what is left; paying it only once
    d more tokens have been made forgoes d tokens' saving on the answers that run on, and spares the
    cost on those that end first. Drafting starts now when that is worth something and no later
    start is worth more (a start just after one of the answers seen would have ended is the best of
    its interval). After one long answer among nine short ones the mean says pay at once; this waits
    out the short ones' lengths and pays only if the answer runs on. An answer cut by its own
    max_tokens counts at the length it reached, which errs toward decoding plain. Before any answer
    has finished, the budget ``left`` stands alone; a sequence already longer than every answer seen
    may make as many again (capped at ``left``)."""

    def __init__(self, keep: int = ANSWERS_KEPT):
        self.seen: deque[int] = deque(maxlen=keep)

    def add(self, made: int) -> None:
        if made > 0:
            self.seen.append(made)

    def rest(self, made: int, left: int) -> list[int]:
        """Tokens still to come, one guess per answer seen that ran longer (see the class docstring)."""
        if not self.seen:
            return [left]
        longer = [min(n - made, left) for n in self.seen if n > made]
        return longer or [min(left, max(made, 1))]

    def draft_now(self, made: int, left: int, saving: float, cost: float) -> bool:
        # the value of a start after w more tokens, summed over the guesses r > w:
        # saving * (sum(r) - w * count) - cost * count; every w a guess is, from the longest down
        rest = sorted(self.rest(made, left), reverse=True)
        total = count = i = 0
        later = float("-inf")
        while i < len(rest):
            w = rest[i]
            later = max(later, saving * (total - w * count) - cost * count)
            while i < len(rest) and rest[i] == w:
                total, count, i = total + w, count + 1, i + 1
        now = saving * total - cost * count
        return now > 0 and now >= later


def calibrate(cost: CostModel, run, widths: list[int], rounds: int = 3) -> None:
    """Time ``run(width)`` (one forward pass of that width) for each width, interleaved over
    ``rounds`` rounds after one warm-up pass, and fold each width's fastest time into ``cost``
    (on a shared machine other work only adds time: one slow round must not set the cost of a
    width the policy then never tries again)."""
    run(widths[0])
    best: dict[int, float] = {}
    for _ in range(rounds):
        for w in widths:
            t0 = time.perf_counter()
            run(w)
            best[w] = min(best.get(w, float("inf")), time.perf_counter() - t0)
    for w in widths:
        cost.add(w, best[w])


class DraftPolicy:
    def __init__(self, k_max: int, adaptive: bool, cost: CostModel, draft_cost=lambda k: 0.0,
                 catch_up_cost=lambda n: 0.0, unread=lambda seq: 0):
        self.k_max, self.adaptive, self.cost = k_max, adaptive, cost
        self.draft_cost = draft_cost  # k -> seconds to propose k tokens (Drafter.draft_cost)
        self.catch_up_cost = catch_up_cost  # n -> seconds to first read n tokens it has not seen
        self.unread = unread  # seq -> tokens its drafter has not read (Drafter.unread)
        self._step = 0
        self._next_probe: int | None = None  # the step of the next probe (set at the first step)
        self.prior = 0.5  # where a new sequence's acceptance estimate starts (see learn)
        self.news = 0  # steps that brought news (learn): the evidence behind the prior
        self.answers = AnswerLengths()  # finished answers' lengths (the catch-up rule's horizon)

    def lengths(self, seqs: list[Sequence], limits: list[int], extra_width: int = 0) -> list[int]:
        """Draft length per sequence; limits[i] caps k (tokens left, context left)."""
        self._step += 1
        for s in seqs:
            if s.accept_ema is None:  # a new sequence: the running acceptance of those before it
                s.accept_ema = self.prior
            if s.accept_slow is None:
                s.accept_slow = s.accept_ema
        caps = [max(0, min(self.k_max, lim)) for lim in limits]
        if not self.adaptive:
            return caps
        caps = [c if c == 0 or self._pays_back(s, lim, c) else 0 for s, lim, c in zip(seqs, limits, caps)]
        ks = [0] * len(seqs)
        width = len(seqs) + extra_width
        tokens = float(len(seqs))
        best_time = self._time(width, ks)
        best, best_ks = tokens / best_time, list(ks)
        # add drafts in order of marginal gain and keep the best point of the whole path: a cost
        # that is not linear in k (a block drafter, a verification width that starts a new tile)
        # can make one draft a loss and five a win
        while True:
            gains = [(s.accept_ema ** (k + 1), i) for i, (s, k) in enumerate(zip(seqs, ks)) if k < caps[i]]
            if not gains:
                break
            gain, i = max(gains)
            ks[i] += 1
            tokens, width = tokens + gain, width + 1
            step_time = self._time(width, ks)
            if tokens / step_time > best:
                best, best_ks, best_time = tokens / step_time, list(ks), step_time
        ks = best_ks
        if any(ks) and self._cost_probe_due(len(seqs) + extra_width, len(seqs) / best, best_time):
            return [0] * len(seqs)
        if self._next_probe is None:
            self._next_probe = self._probe_every(len(seqs) + extra_width)
        if self._step >= self._next_probe:  # the interval is worked out at probes only, not every step
            self._next_probe = self._step + self._probe_every(len(seqs) + extra_width)
            ks = [max(k, min(1, c)) for k, c in zip(ks, caps)]
        if self.news < PRIOR_EVIDENCE:  # too little seen to trust k = 0: learn what the drafter is worth
            ks = [max(k, min(1, c)) for k, c in zip(ks, caps)]
        return ks

    def _cost_probe_due(self, width: int, drafted: float, step_time: float) -> bool:
        """Whether this step decodes plain to re-time ``width``, the step's width at k = 0, which a
        drafting engine otherwise seldom runs (CostModel.age): when it was last timed over
        ``every`` passes ago, with ``every`` such that a probe's loss stays within COST_PROBE_BUDGET
        of decode time. A probe loses the plain step's time less ``drafted`` (the seconds the
        chosen drafts spend on as many tokens) once per ``every`` steps of ``step_time``."""
        age = self.cost.age(width)
        if age is None:
            return False
        loss = max(self.cost.time(width) - drafted, 0.0)
        every = min(COST_PROBE_MAX, max(COST_PROBE_MIN, math.ceil(loss / (COST_PROBE_BUDGET * step_time))))
        return age >= every

    def _pays_back(self, seq: Sequence, left: int, cap: int) -> bool:
        """Whether drafting can repay what the drafter must first read of ``seq`` (a draft model's
        KV catching up on a long prompt: one wide forward, seconds) within the ``left`` tokens the
        sequence may still make, at the most its drafts could save a token at its acceptance. A
        long prompt with a short answer decodes plain (its drafter never reads the prompt); the
        same prompt with a long answer drafts. Only catch-ups longer than PROBE_MAX tokens (a
        prompt's): the shorter ones of a sequence back from k = 0 are the probes' business. How many
        tokens may follow, and whether to wait and see, comes from the finished answers' lengths
        (``answers``, AnswerLengths.draft_now), within ``left``."""
        terms = self.catch_up_terms(seq, cap)
        if terms is None:
            return True
        cost, per_token = terms
        return self.answers.draft_now(len(seq.output_ids), left, self.cost.time(1) - per_token, cost)

    def catch_up_terms(self, seq: Sequence, cap: int) -> tuple[float, float] | None:
        """(seconds of the drafter's catch-up on ``seq``, the least seconds a token costs drafting at
        most ``cap`` at its acceptance) where a catch-up counts (_pays_back), else None."""
        n = self.unread(seq)
        cost = self.catch_up_cost(n) if n > PROBE_MAX else 0.0
        if cost <= 0:
            return None
        p = seq.accept_ema
        return cost, min((self.cost.time(k + 1) + self.draft_cost(k)) / sum(p ** j for j in range(k + 1))
                         for k in range(1, cap + 1))

    def finished(self, seq: Sequence, reason: str) -> None:
        """A sequence ended (by a stop or its budget; an abort says nothing of answers' lengths)."""
        if reason in ("stop", "length"):
            self.answers.add(len(seq.output_ids))

    def _probe_every(self, width: int) -> int:
        """Steps between probes: a drafter that costs a whole forward (a block drafter) probes
        rarely enough that probing stays within PROBE_BUDGET of the decode time. A probe after p
        steps at k = 0 also pays for the drafter reading the p tokens it skipped (a draft model's
        KV catching up), so the interval grows until that fits too, up to PROBE_MAX."""
        d = self.draft_cost(1)
        if d <= 0:
            return PROBE_EVERY
        step = PROBE_BUDGET * self.cost.time(width)
        p = min(PROBE_MAX, max(PROBE_EVERY, math.ceil(d / step)))
        while p < PROBE_MAX and d + self.catch_up_cost(p) > step * p:
            p = min(PROBE_MAX, math.ceil(p * 1.25))
        return p

    def _time(self, width: int, ks: list[int]) -> float:
        k = max(ks, default=0)
        return self.cost.time(width) + (self.draft_cost(k) if k else 0.0)

    def learn(self, seq: Sequence, num_drafted: int, num_accepted: int, cut: bool = False) -> None:
        """One step's outcome: into the sequence's estimate (``update``) and into the prior."""
        share = self.update(seq, num_drafted, num_accepted, cut)
        if share is not None:  # (a sequence with drafts went through lengths(): its estimates are set)
            self.news += 1
            self.prior += max(PRIOR_ALPHA, 1.0 / self.news) * (share - self.prior)  # a mean at first
            if seq.accept_slow is not None:
                seq.accept_slow += SLOW_ALPHA * (share - seq.accept_slow)
                if cut and num_drafted == 0:  # the drafter declined to guess: not one to drift back to
                    seq.accept_slow = min(seq.accept_slow, seq.accept_ema)
        elif seq.accept_slow is not None and seq.accept_ema < seq.accept_slow:  # no news (module docstring)
            seq.accept_ema += IDLE_REVERT * (seq.accept_slow - seq.accept_ema)

    @staticmethod
    def update(seq: Sequence, num_drafted: int, num_accepted: int, cut: bool = False,
               alpha: float = 0.3) -> float | None:
        """Fold one step's outcome into the sequence's acceptance estimate; returns the step's
        accepted share of the draft positions it tried (None: no news). ``cut``: the drafter
        stopped before the length asked for (draft_p_min); the position it did not draft counts
        as a rejection, since the estimate is the chance that asking for one more draft yields one
        more token (else an unsure drafter looks always right and is always asked for k_max, and
        a draft cut to nothing never lowers the estimate while its draft work is spent)."""
        if num_drafted == 0 and not cut:
            return None
        tries = num_accepted + (1 if num_accepted < num_drafted or cut else 0)
        share = num_accepted / tries
        seq.accept_ema = (1 - alpha) * seq.accept_ema + alpha * share
        return share
