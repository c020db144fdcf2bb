"""Time to first token with images: one 448x448 image and five, plain and with the checkpoint's
MTP head, on the tiny test model and on random weights at Qwen3.5-0.8B's real shapes.

    python benchmarks/vision_ttft.py [--models tiny,0.8b] [--runs 3] [--out r.json] [--markdown r.md]

No Qwen3.5 checkpoint ships inside a package on the registries this project installs from, so
"0.8b" is random weights at the published Qwen3.5-0.8B shapes: the text model of
benchmarks/hybrid_speed.py (SHAPES) and the vision tower below (VISION: 12 blocks, hidden 768,
12 heads, 16-pixel patches, 2x2 merge, out 1024), bf16 safetensors with an MTP layer, loaded
as ``specserve serve`` would (the CPU's default weight format for the text model, the tower in
float32). "tiny" is tests/data/tiny_qwen35_vl/hf. A 448x448 image is 28 x 28 patches, 196
tokens after the merge.

Each configuration is one engine (prefix caching off, so nothing is reused between runs); a
warm-up request first, then ``--runs`` requests with images never seen before, timed from
the decoded pictures (preprocessing, encoding, prefill) to the first token; the median is reported, and the part of it the vision
encoder took. Plain and MTP run side by side in one process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests")]

# Qwen3.5-0.8B's vision_config (the published config.json)
VISION = dict(depth=12, hidden_size=768, hidden_act="gelu_pytorch_tanh", intermediate_size=3072, num_heads=12,
              in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=1024,
              num_position_embeddings=2304)
# Qwen3.5's preprocessor_config.json (Qwen2VLImageProcessor)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
                "merge_size": 2, "do_resize": True, "do_rescale": True, "do_normalize": True,
                "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
TEXT = "Describe what you see in these pictures, then list the shapes and their colours."


def random_vl_checkpoint(out: Path) -> Path:
    """Random bf16 weights under transformers' names and shapes (from a meta-device model)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from hybrid_speed import SHAPES, random_tensors
    from tiny_models import VL_IDS, write_vl_tokenizer

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = transformers.Qwen3_5Config(text_config=SHAPES, vision_config=VISION, tie_word_embeddings=True, **VL_IDS)
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForConditionalGeneration(cfg)
    text = SimpleNamespace(config=cfg.text_config, model=hf.model.language_model)
    tensors = random_tensors(hf, text, torch.Generator().manual_seed(0))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.text_config.mtp_num_hidden_layers = 1
    cfg.save_pretrained(out)
    write_vl_tokenizer(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    return out


def square(seed: int, side: int = 448):
    from test_vision import picture

    return picture(seed, (side, side))


def ttft(target, method: str, n_images: int, runs: int) -> dict:
    """Median time to first token (s) and the vision encoder's part of it."""
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.engine.types import SamplingParams
    from specserve.speculative.config import SpeculativeConfig
    from specserve.speculative.mtp import MTPDrafter
    from test_vision import build

    spec, drafter = None, None
    if method == "mtp":
        spec = SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False)
        drafter = MTPDrafter.load(None, target)
    eng = LLMEngine(target, EngineConfig(max_model_len=2048, enable_prefix_caching=False, max_num_seqs=2),
                    spec, drafter)
    enc = eng.runner.encoder
    encode, spent = enc.encode, [0.0]

    def timed(pixels, grid):
        t = time.perf_counter()
        out = encode(pixels, grid)
        spent[0] += time.perf_counter() - t
        return out

    enc.encode = timed
    times, enc_times, tokens = [], [], 0
    for r in range(runs + 1):  # run 0 warms up
        pictures = [square(1000 * n_images + 10 * r + i) for i in range(n_images)]
        spent[0] = 0.0
        t0 = time.perf_counter()  # from the decoded pictures: preprocessing, encoding, prefill
        ids, images = build(target, [*pictures, TEXT])
        tokens = len(ids)
        eng.add_request(f"r{r}", ids, SamplingParams(max_tokens=2, ignore_eos=True), images)
        first = None
        while eng.has_work():
            for out in eng.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - t0
        if r:
            times.append(first)
            enc_times.append(spent[0])
    return {"ttft_s": statistics.median(times), "encoder_s": statistics.median(enc_times), "prompt_tokens": tokens,
            "runs": times}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def markdown(res: dict, cpu: str) -> str:
    lines = [f"CPU: {cpu}, 2 threads. Median of {res['runs']} requests with new images each; TTFT from the decoded "
             "pictures (preprocessing, vision encoder, prefill) to the first token, in-process.", "",
             "| model | images (448x448) | prompt tokens | plain TTFT s | MTP TTFT s | MTP / plain | encoder s |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in res["models"].items():
        for n, r in rows.items():
            p, m = r["plain"], r["mtp"]
            lines.append(f"| {name} | {n} | {p['prompt_tokens']} | {p['ttft_s']:.3f} | {m['ttft_s']:.3f} | "
                         f"{m['ttft_s'] / p['ttft_s']:.2f} | {p['encoder_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from specserve.models.catalog import cache_root
    from specserve.models.loader import load_model
    from tiny_models import FP32

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,0.8b")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    res = {"runs": args.runs, "models": {}}
    for name in args.models.split(","):
        if name == "tiny":
            target = load_model(str(HERE.parent / "tests" / "data" / "tiny_qwen35_vl" / "hf"), FP32)
        else:
            target = load_model(str(random_vl_checkpoint(cache_root() / "bench" / "qwen35-0.8b-vl-random")))
        res["models"][name] = {n: {m: ttft(target, m, n, args.runs) for m in ("plain", "mtp")} for n in (1, 5)}
        print(json.dumps({name: res["models"][name]}, indent=1), flush=True)
    text = markdown(res, cpu_name())
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
