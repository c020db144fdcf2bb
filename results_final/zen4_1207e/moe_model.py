"""What this directory's scripts time: the 4-layer Qwen3.5-35B-A3B-shaped file (hybrid_speed.py
--model 35b-a3b --layers 4) in an engine decoding one request, warmed by 10 steps."""

import time

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.models.catalog import cache_root
from specserve.models.loader import load_model

GGUF = cache_root() / "bench" / "qwen35-35b-a3b-random-4l" / "qwen35-35b-a3b-random-4l-q4_k_m.gguf"


def decoding_engine(max_model_len: int = 1024, max_tokens: int = 1000, path=GGUF):
    """(the loaded model, an engine with one request decoding, 10 steps in)."""
    m = load_model(str(path))
    eng = LLMEngine(m, EngineConfig(max_model_len=max_model_len, max_num_seqs=2))
    eng.add_request("a", list(range(100, 116)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for _ in range(10):
        eng.step()
    return m, eng


def timed(spent: dict, label: str, fn):
    """fn, adding its wall time to spent[label] on every call."""
    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
        return out
    return wrapper
