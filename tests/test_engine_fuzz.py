"""Random traffic on a tiny model: shared prefixes (prefix-cache hits), a tight KV pool
(preemption), chunked prefill, aborts, with and without a dflash drafter and its prefix store.
Every request that is not aborted gets plain greedy's tokens; no block leaks."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.spec.config import SpecConfig
from specserve.spec.dflash import DFlashDrafter, save_drafter
from specserve.spec.prefix_store import PrefixStore
from test_dflash import _engine, make_tiny_target, random_drafter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tiny = make_tiny_target(tmp_path_factory.mktemp("tiny_fuzz"))
    m = random_drafter(tiny, block_size=4)
    d = tmp_path_factory.mktemp("drafter")
    save_drafter(m, m.cfg.to_json(), d)
    return tiny, d, _engine(tiny)


def _plain(ref: LLMEngine, ids: list[int], n: int, rid: str) -> list[int]:
    return [t for o in ref.generate(ids, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
            for t in o.new_token_ids]


def _random_engine(tiny, drafter_dir, rnd: random.Random, per_token: int) -> LLMEngine:
    spec, drafter = None, None
    if rnd.random() < 0.6:
        spec = SpecConfig("dflash", num_speculative_tokens=rnd.choice([1, 3]), model="x", adaptive=rnd.random() < 0.5)
        drafter = DFlashDrafter.load(drafter_dir, tiny, store=PrefixStore(rnd.choice([4, 64]), 8))
    ecfg = EngineConfig(max_num_seqs=rnd.choice([2, 4, 6]), max_model_len=96, block_size=8,
                        max_num_batched_tokens=rnd.choice([16, 64, 2048]),
                        kv_cache_memory=per_token * 8 * rnd.choice([13, 20, 40]))
    return LLMEngine(tiny, ecfg, spec, drafter)


@pytest.mark.parametrize("trial", range(12))
def test_random_traffic_keeps_outputs_and_blocks(setup, trial):
    tiny, drafter_dir, ref = setup
    rnd = random.Random(trial)
    eng = _random_engine(tiny, drafter_dir, rnd, ref.plan.kv_bytes_per_token)
    bases = [[rnd.randrange(256) for _ in range(rnd.randrange(5, 40))] for _ in range(3)]
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
            assert got[rid] == _plain(ref, ids, n, f"ref-{trial}-{rid}"), rid
    eng.blocks.check_invariants()
    assert eng.blocks.num_free == eng.blocks.num_blocks
