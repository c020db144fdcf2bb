"""Running streams' inter-token latency while an image request arrives: images encoded whole in
one step (fixed chunks, ``--max-step-ms 0``) vs encoded ahead a slice per step (the step budget).

    python benchmarks/vision_stall.py [--streams 4] [--images 2] [--out r.json] [--markdown r.md]

In-process, on random weights at Qwen3.5-0.8B's shapes (benchmarks/vision_ttft.py builds them):
--streams greedy text streams decode; once each has a token, a request with --images 448x448
images and a short question arrives. Every gap between two tokens of a stream that ends between
the image request's arrival and its first token is its stall; reported per configuration: the
streams' p50 / p99 / longest gap then, and the image request's time to first token; and whether
the outputs are identical across configurations (the streams' tokens and the image answer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests")]

CONFIGS = {"whole images, fixed chunks (--max-step-ms 0)": 0.0, "encoded ahead, step budget (default)": 150.0}


def run(target, max_step_ms: float, n_streams: int, n_images: int) -> dict:
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.engine.types import SamplingParams
    from test_vision import build
    from vision_ttft import TEXT, square

    eng = LLMEngine(target, EngineConfig(max_model_len=2048, max_num_seqs=n_streams + 1, max_step_ms=max_step_ms,
                                         enable_prefix_caching=False))
    params = SamplingParams(max_tokens=1500, ignore_eos=True)
    for i in range(n_streams):
        eng.add_request(f"s{i}", target.tokenizer.encode(f"stream {i}: tell a long story."), params)
    times: dict[str, list[float]] = {f"s{i}": [] for i in range(n_streams)}
    tokens: dict[str, list[int]] = {k: [] for k in [*times, "img"]}

    def step() -> None:
        outs = eng.step()
        now = time.perf_counter()
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
            if out.request_id in times and out.new_token_ids:
                times[out.request_id].append(now)

    while not all(times.values()):
        step()
    ids, images = build(target, [*[square(500 + i) for i in range(n_images)], TEXT])
    t0 = time.perf_counter()
    eng.add_request("img", ids, SamplingParams(max_tokens=8, ignore_eos=True), images)
    while not tokens["img"]:
        step()
    first = time.perf_counter()
    for _ in range(3):  # a few steps more, so the last stall has an end
        step()
    gaps = [(b - a) * 1000 for ts in times.values() for a, b in zip(ts, ts[1:]) if t0 < b <= first + 1e-9]
    for rid in list(times) + ["img"]:
        eng.abort(rid)
    gaps.sort()
    return {"ttft_s": first - t0, "gap_p50_ms": statistics.median(gaps), "gap_p99_ms": gaps[int(0.99 * (len(gaps) - 1))],
            "gap_max_ms": gaps[-1], "stream_tokens_during": len(gaps), "prompt_tokens": len(ids), "tokens": tokens}


def main() -> None:
    from specserve.models.catalog import cache_root
    from specserve.models.loader import load_model
    from vision_ttft import cpu_name, random_vl_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    target = load_model(str(random_vl_checkpoint(cache_root() / "bench" / "qwen35-0.8b-vl-random")))
    res = {name: run(target, ms, args.streams, args.images) for name, ms in CONFIGS.items()}
    runs = list(res.values())
    n = {k: min(len(r["tokens"][k]) for r in runs) for k in runs[0]["tokens"]}
    same = all(r["tokens"][k][:n[k]] == runs[0]["tokens"][k][:n[k]] for r in runs for k in n)
    lines = [f"CPU: {cpu_name()}, 2 threads. Random weights at Qwen3.5-0.8B's shapes; {args.streams} greedy text "
             f"streams decode while a request with {args.images} 448x448 images ({runs[0]['prompt_tokens']} prompt "
             "tokens) arrives; in-process.", "",
             "| config | stream ITL p50 | p99 | longest | stream tokens meanwhile | image request's TTFT | outputs identical |",
             "|---|---:|---:|---:|---:|---:|:---:|"]
    for name, r in res.items():
        lines.append(f"| {name} | {r['gap_p50_ms']:.0f} ms | {r['gap_p99_ms']:.0f} ms | {r['gap_max_ms']:.0f} ms | "
                     f"{r['stream_tokens_during']} | {r['ttft_s']:.2f} s | {'yes' if same else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps({k: {f: v for f, v in r.items() if f != "tokens"} for k, r in res.items()}
                                             | {"outputs_identical": same}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
