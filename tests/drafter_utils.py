"""What the drafter test modules share: a random dflash drafter big enough that every input
matters, a sequence with output so far, an engine that logs its drafter's proposals, and the
prefix-cache check every drafter with a context store passes."""

from __future__ import annotations

import torch

from engine_utils import run_all
from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.sequence import Sequence
from specserve.engine.types import SamplingParams
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.dflash import DFlashConfig, DFlashModel

CHAT4 = ["Write a Python function that checks whether a number is prime.",
         "What is 12 * 13? Explain briefly.",
         "Describe a sunrise over the sea in two sentences.",
         "List three uses of a paperclip."]


def random_drafter(target, block_size: int = 4, layers: int = 2, seed: int = 0) -> DFlashModel:
    cfg = DFlashConfig.for_target(target, num_layers=layers, block_size=block_size)
    m = DFlashModel(cfg)
    m.init_weights(1.0, target.model.final_norm, seed)
    with torch.no_grad():  # big enough that every input matters
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(10)
    return m


def seq_with_output(ids: list[int], n_prompt: int, params=SamplingParams()) -> Sequence:
    """A sequence with a prompt of ids[:n_prompt] and ids[n_prompt:] as its output so far."""
    s = Sequence("s0", ids[:n_prompt], params, detok=None)
    s.output_ids = ids[n_prompt:]
    return s


def logged_engine(target, drafter, method: str, prefix_caching: bool):
    """An engine whose drafter records every proposal as (anchor position, drafts)."""
    eng = LLMEngine(target, EngineConfig(max_num_seqs=1, max_model_len=256, block_size=8,
                                         enable_prefix_caching=prefix_caching),
                    SpeculativeConfig(method, num_speculative_tokens=3, model="x", adaptive=False), drafter)
    eng.log = []
    propose = drafter.propose

    def logged(seqs, ks):
        props = propose(seqs, ks)
        eng.log += [(s.num_tokens - 1, p.token_ids) for s, p in zip(seqs, props)]
        return props

    drafter.propose = logged
    return eng


def check_prefix_hits_keep_context(target, load, method: str) -> None:
    """A request that starts from cached blocks (a repeated prompt, then a second chat turn that
    extends the first one's prompt and answer) drafts exactly as without prefix caching; without
    the drafter's prefix store it drafts differently (blind to the cached blocks).
    load(store) -> a fresh drafter using that PrefixStore (or None)."""
    from specserve.speculative.prefix_store import PrefixStore

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (37,), generator=g).tolist()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    cold = logged_engine(target, load(None), method, prefix_caching=False)
    want = run_all(cold, [prompt], params)[0]
    turn2 = prompt + want + torch.randint(0, 256, (9,), generator=g).tolist()
    want2 = run_all(cold, [turn2], params)[0]
    for store in (PrefixStore(64, 8), None):
        eng = logged_engine(target, load(store), method, prefix_caching=True)
        assert run_all(eng, [prompt], params)[0] == want  # fills the prefix cache (and the store)
        eng.log.clear()
        assert run_all(eng, [prompt], params)[0] == want  # 32 of 37 prompt tokens cached
        assert run_all(eng, [turn2], params)[0] == want2  # the first turn's prompt + answer cached
        assert eng.blocks.num_free == eng.blocks.num_blocks
        if store is None:
            assert eng.log != cold.log
        else:
            assert eng.log == cold.log
            assert len(store) == (len(turn2) + 20 - 1) // 8  # every full block of verified tokens
            per_block = max(sum(t.nbytes for t in rows) for _, rows in store._rows.values())
            assert eng.drafter.kv_bytes() == store.capacity * per_block  # what plan counts: the store when full
            assert eng.plan.drafter_kv_bytes == eng.drafter.kv_bytes()
