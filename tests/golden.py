"""Golden greedy token ids: fixed prompts through fixed engine configurations.

The committed file ``tests/data/golden_tokens.json`` holds what these cases produced before the
engine's structure was redesigned; ``tests/test_golden.py`` reruns them and compares token for
token. A structural change must not move a single token. A commit that changes kernel arithmetic
on purpose regenerates the file (``python tests/golden.py --write``) and says why.

Every case runs greedy decoding of the same prompts, so each one is also a losslessness check:
the speculative and chunked / cached configurations must equal the plain ones of their model
(``test_golden.py`` asserts that too).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_utils import bench_prompts, chat_ids, make_engine, run_all  # noqa: E402

from specserve.engine.types import SamplingParams  # noqa: E402

GOLDEN_FILE = HERE / "data" / "golden_tokens.json"
MAX_TOKENS = 32
SYSTEM = ("You are a meticulous assistant for a team of software engineers. Answer precisely, "
          "show code when it helps, and keep explanations short. ") * 3  # a shared prefix of several blocks


@dataclass(frozen=True)
class Case:
    """One engine configuration over the first ``num_prompts`` golden prompts of ``model``."""

    name: str
    model: str
    args: tuple[str, ...] = ()
    num_prompts: int = 8
    repeat: bool = False  # run the prompts twice through one engine and keep the second pass (prefix-cache hits)
    reference: str | None = None  # the plain case whose tokens these must equal (losslessness)
    extra: dict = field(default_factory=dict)


def _spec(**kw) -> tuple[str, ...]:
    return ("--speculative-config", json.dumps(kw))


SMOL = "smollm2-135m"
CASES: tuple[Case, ...] = (
    Case("smollm2/plain-batch8", SMOL),
    Case("smollm2/ngram", SMOL, _spec(method="ngram", num_speculative_tokens=6, adaptive=False,
                                      prompt_lookup_min=1, prompt_lookup_max=3), reference="smollm2/plain-batch8"),
    Case("smollm2/ngram-adaptive", SMOL, _spec(method="ngram", num_speculative_tokens=8),
         reference="smollm2/plain-batch8"),
    Case("smollm2/draft_model-int8", SMOL, _spec(method="draft_model", model=SMOL, quantization="int8",
                                                 num_speculative_tokens=4, adaptive=False),
         reference="smollm2/plain-batch8"),
    Case("smollm2/dflash", SMOL, _spec(method="dflash", model="smollm2-135m-dflash", num_speculative_tokens=7,
                                       adaptive=False), reference="smollm2/plain-batch8"),
    Case("smollm2/mtp-random", SMOL, extra={"mtp_seed": 0}, reference="smollm2/plain-batch8"),
    Case("smollm2/chunked-prefill-16", SMOL, ("--max-num-batched-tokens", "16"), reference="smollm2/plain-batch8"),
    Case("smollm2/prefix-cache-hits", SMOL, repeat=True, reference="smollm2/plain-batch8"),
    Case("smollm2/one-at-a-time", SMOL, ("--max-num-seqs", "1"), reference="smollm2/plain-batch8"),
    *(Case(f"smollm2/kv-{dt}", SMOL, ("--kv-cache-dtype", dt), num_prompts=4)
      for dt in ("bf16", "fp16", "fp8_e4m3", "int8", "int4")),
    Case("smollm2/kv-int8-ngram", SMOL, ("--kv-cache-dtype", "int8") + _spec(
        method="ngram", num_speculative_tokens=6, adaptive=False, prompt_lookup_min=1), num_prompts=4,
         reference="smollm2/kv-int8"),
    Case("gemma3/plain", "gemma3-270m", num_prompts=4),
    Case("gemma3/ngram", "gemma3-270m", _spec(method="ngram", num_speculative_tokens=6, adaptive=False,
                                              prompt_lookup_min=1), num_prompts=4, reference="gemma3/plain"),
    Case("gemma3/chunked-prefill-16", "gemma3-270m", ("--max-num-batched-tokens", "16"), num_prompts=4,
         reference="gemma3/plain"),
    Case("qwen0.5b/plain", "qwen2.5-coder-0.5b", num_prompts=4),
    Case("qwen0.5b/ngram", "qwen2.5-coder-0.5b", _spec(method="ngram", num_speculative_tokens=6, adaptive=False,
                                                        prompt_lookup_min=1), num_prompts=4,
         reference="qwen0.5b/plain"),
)


def golden_texts() -> list[str]:
    """8 prompts: code, math and prose from the bench suites, two of them long, all behind one system prompt."""
    texts = bench_prompts(3)[:6]
    texts += ["Repeat after me: the quick brown fox jumps over the lazy dog. " * 4,
              "Summarize in one sentence: " + "Speculative decoding drafts tokens cheaply and verifies them. " * 12]
    return texts


def _prompt_ids(engine, model: str, n: int) -> list[list[int]]:
    texts = golden_texts()[:n]
    if model == "gemma3-270m":  # a base model without a chat template: plain text
        return [engine.tokenizer.encode(SYSTEM + t) for t in texts]
    return [chat_ids(engine, SYSTEM + t) for t in texts]


def _mtp_args(tmp: Path, seed: int) -> tuple[str, ...]:
    from specserve.models.loader import load_model
    from specserve.speculative.drafter_files import save_drafter
    from specserve.speculative.train.trainer import make_model

    head = make_model("mtp", load_model(SMOL), seed=seed)  # random-init head: drafts, mostly rejected
    save_drafter(head, head.cfg.to_json(), tmp / "mtp")
    return _spec(method="mtp", model=str(tmp / "mtp"), num_speculative_tokens=3, adaptive=False)


def run_case(case: Case, tmp: Path) -> list[list[int]]:
    args = case.args
    if "mtp_seed" in case.extra:
        args = args + _mtp_args(tmp, case.extra["mtp_seed"])
    engine = make_engine("--model", case.model, *args)
    prompts = _prompt_ids(engine, case.model, case.num_prompts)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    got = run_all(engine, prompts, params)
    if case.repeat:
        got = run_all(engine, prompts, params)
        assert engine.blocks.num_free == engine.blocks.num_blocks
    return got


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="write tests/data/golden_tokens.json")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    a = ap.parse_args()
    names = set(filter(None, a.cases.split(",")))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if names and case.name not in names:
                continue
            out[case.name] = run_case(case, Path(tmp))
            print(case.name, [len(t) for t in out[case.name]], flush=True)
    if a.write:
        GOLDEN_FILE.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN_FILE.write_text(json.dumps(out, indent=0) + "\n")
        print("wrote", GOLDEN_FILE)


if __name__ == "__main__":
    main()
