"""Random traffic on a tiny model: shared prefixes (prefix-cache hits), a tight KV pool
(preemption), chunked prefill, aborts, quantized KV caches; without speculation, with prompt
lookup and suffix decoding (on prompts that repeat themselves, so they draft), with each drafter
that keeps state per sequence (dflash and MTP with their prefix stores, a draft model with its
own KV, reading all it missed or a window of it), and with a chain of a model-free drafter and one of those.
Every request that is not aborted gets plain greedy's tokens (same KV dtype); no block leaks."""

from __future__ import annotations

import random

import pytest

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine, plan_for
from specserve.engine.types import SamplingParams
from specserve.speculative.chain import ChainDrafter
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.dflash import DFlashDrafter
from specserve.speculative.drafter_files import save_drafter
from specserve.speculative.draft_model import DraftModelDrafter
from specserve.speculative.mtp import MTPDrafter
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.prefix_store import PrefixStore
from specserve.speculative.suffix import SuffixDrafter
from drafter_utils import random_drafter
from tiny_models import make_tiny_target
from test_mtp import random_head


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tiny = make_tiny_target(tmp_path_factory.mktemp("tiny_fuzz"))
    m, head = random_drafter(tiny, block_size=4), random_head(tiny, seed=4)
    dirs = {"dflash": tmp_path_factory.mktemp("dflash"), "mtp": tmp_path_factory.mktemp("mtp")}
    save_drafter(m, m.cfg.to_json(), dirs["dflash"])
    save_drafter(head, head.cfg.to_json(), dirs["mtp"])
    draft = make_tiny_target(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=1)
    return tiny, dirs, draft, {}


KV_DTYPES = ("auto", "int8", "int4", "fp8_e4m3", "bf16")  # one per trial


def _plain(setup, kv_dtype: str, ids: list[int], n: int, rid: str) -> list[int]:
    tiny, refs = setup[0], setup[-1]
    if kv_dtype not in refs:
        refs[kv_dtype] = LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_model_len=256, kv_cache_dtype=kv_dtype))
    return [t for o in refs[kv_dtype].generate(ids, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
            for t in o.new_token_ids]


def _random_engine(setup, method: str, rnd: random.Random, kv_dtype: str) -> LLMEngine:
    tiny, dirs, draft, _ = setup
    probe = EngineConfig(max_model_len=96, block_size=8, kv_cache_dtype=kv_dtype)
    per_token = plan_for(tiny, probe, None, None).kv_bytes_per_token
    spec, drafter = None, None
    store = PrefixStore(rnd.choice([4, 64]), 8)
    k = rnd.choice([1, 3, 5]) if method != "none" else 0
    if method == "chain":
        parts = rnd.choice([("suffix", "draft_model"), ("ngram", "dflash"), ("suffix", "mtp")])
        drafter = ChainDrafter([_drafter(setup, m, rnd, store) for m in parts], [k, rnd.choice([1, k])])
        spec = SpeculativeConfig("chain", num_speculative_tokens=k, adaptive=rnd.random() < 0.5,
                          drafters=tuple(SpeculativeConfig(m, num_speculative_tokens=k,
                                                    model=None if m in ("ngram", "suffix") else "x") for m in parts))
    elif method != "none":
        spec = SpeculativeConfig(method, num_speculative_tokens=k, model=None if method in ("ngram", "suffix") else "x",
                          adaptive=rnd.random() < 0.5)
        drafter = _drafter(setup, method, rnd, store)
    ecfg = EngineConfig(max_num_seqs=rnd.choice([2, 4, 6]), max_model_len=96, block_size=8,
                        max_num_batched_tokens=rnd.choice([16, 64, 2048]), kv_cache_dtype=kv_dtype,
                        kv_cache_memory=per_token * 8 * rnd.choice([13, 20, 40]))
    return LLMEngine(tiny, ecfg, spec, drafter)


def _drafter(setup, method: str, rnd: random.Random, store: PrefixStore):
    tiny, dirs, draft, _ = setup
    if method == "dflash":
        return DFlashDrafter.load(dirs["dflash"], tiny, store=store)
    if method == "mtp":
        return MTPDrafter.load(str(dirs["mtp"]), tiny, store)
    if method == "draft_model":  # a window of 16 (+ 16 sinks): prompts past 32 tokens are read in part
        return DraftModelDrafter(draft, 60, 8, 96, window=rnd.choice([0, 16]))
    if method == "suffix":  # a small global cache: evictions happen
        return SuffixDrafter(rnd.choice([4, 24]), rnd.choice([0, 3, 100]), min_token_prob=rnd.choice([0.0, 0.1]))
    return NgramDrafter(1, rnd.choice([2, 4]))


def _repetitive(rnd: random.Random) -> list[int]:
    """A prompt that repeats a short unit: n-grams that recur, so prompt lookup drafts."""
    unit = [rnd.randrange(256) for _ in range(rnd.randrange(2, 6))]
    return (unit * 10)[:rnd.randrange(5, 40)]


@pytest.mark.parametrize("method", ["none", "ngram", "dflash", "mtp", "draft_model", "suffix", "chain"])
@pytest.mark.parametrize("trial", range(len(KV_DTYPES)))
def test_random_traffic_keeps_outputs_and_blocks(setup, method, trial):
    rnd = random.Random(trial)
    kv_dtype = KV_DTYPES[trial]
    eng = _random_engine(setup, method, rnd, kv_dtype)
    bases = [_repetitive(rnd) if rnd.random() < 0.5 else [rnd.randrange(256) for _ in range(rnd.randrange(5, 40))]
             for _ in range(3)]
    reqs: dict[str, tuple[list[int], int]] = {}
    got: dict[str, list[int]] = {}
    done, aborted = set(), set()
    steps = 0
    while len(reqs) < 12 or eng.has_work():
        if len(reqs) < 12 and rnd.random() < 0.4:  # a new request sharing a prefix with others
            base = rnd.choice(bases)
            ids = base[:rnd.randrange(1, len(base) + 1)] + [rnd.randrange(256) for _ in range(rnd.randrange(12))]
            rid = f"f{len(reqs)}"
            reqs[rid], got[rid] = (ids, rnd.randrange(1, 40)), []
            eng.add_request(rid, ids, SamplingParams(max_tokens=reqs[rid][1], ignore_eos=True))
        if reqs and rnd.random() < 0.03:
            rid = rnd.choice(list(reqs))
            if rid not in done:
                eng.abort(rid)
                aborted.add(rid)
                done.add(rid)
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                done.add(out.request_id)
        steps += 1
        assert steps < 5000, "the engine stopped making progress"
    for rid, (ids, n) in reqs.items():
        if rid not in aborted:
            assert got[rid] == _plain(setup, kv_dtype, ids, n, f"ref-{method}-{trial}-{rid}"), rid
    eng.blocks.check_invariants()
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert (eng.totals.draft_tokens > 0) == (method != "none")  # the drafters did draft
    if method == "draft_model":  # the draft's own blocks all given back too
        eng.drafter.blocks.check_invariants()
        assert eng.drafter.blocks.num_free == eng.drafter.blocks.num_blocks
