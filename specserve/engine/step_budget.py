"""Prefill chunks sized by time: the per-step budget of ``--max-step-ms``.

A step runs the running streams' decode rows and prefill chunks of new prompts in one forward,
so every stream waits for the whole step before its next token: a fixed token budget
(``--max-num-batched-tokens``) lets one long prompt stall them for seconds. Here the prefill
chunks of a step get as many tokens as fit in ``max_step_ms`` milliseconds of forward, as the
engine's cost model predicts from measured passes (``CostModel.passes`` in
specserve/speculative/adaptive.py: ``a + b * rows + c * keys``, keys being the attention work).

Context matters: a chunk late in an 8K-token prompt attends to everything before it, so it
costs several times more per token than one at the start. The prediction takes each chunk
token at the context of the prompt with the most computed so far (the longest attention this
step can see): exact for the usual one prompt in prefill, and it can only over-estimate when
several prefill at once (a smaller chunk, never a longer stall). The fit is only trusted near
what was measured: a pass may be at most twice as wide, and attend at most twice as many keys,
as the widest one seen, so after start-up (or a cold cost model) chunks grow step by step
instead of jumping to a guess.

When the decode rows alone take the budget (many streams at long contexts, or a machine so
contended that every pass costs a second whatever its width), a step may take up to
STALL_FACTOR times what they alone would: the streams are slowed by at most that factor and the
prompt still advances at a useful rate (on a contended machine, where a pass's fixed cost
dominates, a 32-token chunk costs nearly what a 200-token one does). And each step gives a
prefill at least MIN_CHUNK tokens.

Chunk sizes never change outputs: the kernels are batch-invariant (tests/test_step_budget.py
checks the tokens with the budget on against one-shot prefill).

Without decode rows nobody waits, so the budget does not apply (the prompt prefills at full
width); ``max_step_ms`` 0 turns it off (the fixed ``--max-num-batched-tokens`` chunks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.speculative.adaptive import PassFit

DEFAULT_MAX_STEP_MS = 150.0  # p99 stream ITL under ~250 ms while an 8K prompt arrives (README "Long prompts")
# tokens a prefill gets per step whatever the budget (it always advances); 8, not 32: with 32, late
# in an 8K-token prompt the minimum chunk alone outlasted the budget (p99 ITL 421 ms against 218 ms
# with 8, smollm2-135m; results_final/prefill_stall*.md)
MIN_CHUNK = 8
STALL_FACTOR = 2.0  # a step may take this many times the decode rows' own time, if that exceeds the budget
EXPLORE = 64  # passes up to this wide (and this many keys squared) need no measurement to be tried


def row_keys(count: int, start: int) -> int:
    """Keys attended by ``count`` rows at positions start .. start + count - 1 (row p sees p + 1)."""
    return count * start + count * (count + 1) // 2


def batch_keys(positions) -> int:
    """Keys attended by a forward batch: the sum over its rows of position + 1 (a 1-D tensor)."""
    return int(positions.sum()) + int(positions.numel())


def prefill_budget(passes: PassFit, max_step_ms: float, decode: list[tuple[int, int]],
                   prefill_starts: list[int], tokens: int) -> int:
    """Tokens this step's prefill chunks may take, at most ``tokens`` (what --max-num-batched-tokens
    leaves after the decode rows).

    ``decode``: (rows, first position) of each sequence's decode rows this step;
    ``prefill_starts``: tokens already computed of each sequence still prefilling.
    """
    if max_step_ms <= 0 or not decode or not prefill_starts or tokens <= 0:
        return tokens
    rows0 = sum(n for n, _ in decode)
    keys0 = sum(row_keys(n, p) for n, p in decode)
    start = max(prefill_starts)
    budget_s = max(max_step_ms / 1000.0, STALL_FACTOR * passes.time(rows0, keys0))
    max_rows = max(2 * passes.widest, EXPLORE)
    max_keys = max(2 * passes.most_keys, EXPLORE * EXPLORE)

    def fits(c: int) -> bool:
        keys = keys0 + row_keys(c, start)
        return rows0 + c <= max_rows and keys <= max_keys and passes.time(rows0 + c, keys) <= budget_s

    lo, hi = 0, tokens  # fits(lo) holds, the answer is in [lo, hi]; time grows with c
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return min(tokens, max(lo, MIN_CHUNK))
