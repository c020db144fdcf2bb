"""What a speculative step with the checkpoint's own MTP head costs at Qwen3.5-0.8B's shapes
(hybrid_speed.py's Q4_K_M file, random weights with a random MTP layer, so nothing is accepted and
only the costs mean anything): k = 3 drafts a step, the head's layer in int8 (the CPU default), its
drafts from the full 248,320-token LM head or from one cut to a 32K draft vocabulary; ms a step, in
the drafter's propose and in the target's 4-row verification forward, 40 steps after 10.

    python results_final/zen4_1208/mtp_step.py > results_final/zen4_1208/mtp_step.txt
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zen4_1207e"))

from specserve.engine.config import EngineConfig  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.models.catalog import cache_root  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from specserve.speculative.mtp import MTPDrafter  # noqa: E402

from moe_model import decoding_engine, timed  # noqa: E402

GGUF = cache_root() / "bench" / "qwen35-0.8b-random" / "qwen35-0.8b-random-q4_k_m.gguf"


def main() -> None:
    lm = load_model(str(GGUF))
    _, plain = decoding_engine(max_model_len=1024, max_tokens=400, path=GGUF)
    t0 = time.perf_counter()
    for _ in range(40):
        plain.step()
    print(f"plain decode step: {(time.perf_counter() - t0) / 40 * 1e3:.2f} ms")
    for vocab in (None, 32768):
        d = MTPDrafter.load(None, lm, None, 0.0, "int8", vocab)
        spent: dict = {}
        d.propose = timed(spent, "propose", d.propose)
        eng = LLMEngine(lm, EngineConfig(max_model_len=1024, max_num_seqs=2),
                        SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False), d)
        eng.add_request("a", list(range(100, 116)), SamplingParams(max_tokens=400, ignore_eos=True))
        for _ in range(10):
            eng.step()
        spent.clear()
        forward = lm.model.forward
        lm.model.forward = timed(spent, "verify", forward)
        t0 = time.perf_counter()
        for _ in range(40):
            eng.step()
        step = (time.perf_counter() - t0) / 40 * 1e3
        del lm.model.forward
        print(f"MTP k=3, draft vocabulary {vocab or 'full'}: step {step:.2f} ms; propose {spent['propose'] / 40 * 1e3:.2f} "
              f"ms (3 drafts); 4-row verification forward {spent['verify'] / 40 * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
