"""Hybrid Qwen3.5 speed at the real shapes of Qwen3.5-0.8B (random weights), us vs native llama.cpp.

    python benchmarks/hybrid_speed.py [--types q8_0,q4_k_m] [--prefill 2048,8192] [--decode 64]
        [--widths 1-9] [--out r.json] [--markdown r.md] [--model 0.8b | 35b-a3b] [--layers N]

``--model 35b-a3b`` takes Qwen3.5-35B-A3B's shapes instead (mixture of experts: 256 experts of
width 512, 8 per token, and a shared expert in every layer; no MTP layer), with ``--layers`` to keep
the first N of its 40 layers so that the file fits this machine.

No Qwen3.5 checkpoint ships inside a package on the registries this project installs from, so
the model is random weights at the published Qwen3.5-0.8B text shapes (SHAPES below: 24 layers,
18 Gated DeltaNet + 6 gated attention, hidden 1024, vocabulary 248,320, tied embeddings),
written as safetensors, converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (Q8_0) and
llama-quantize (Q4_K_M), from the llama-cpp-python sdist that benchmarks/native_llamacpp.py
builds. Both engines read the same file, one at a time, 2 threads:

* llama.cpp: ``llama-bench -t 2 -p 2048,8192 -n 64`` (prompt processing and generation tok/s),
  and ``-p 1..9`` for the forward cost of w rows at an empty context;
* specserve: the engine itself (fp32 KV, the file's blocks as weights): a 2K / 8K prompt prefilled
  (chunks of 2048, --max-step-ms 0) timed to its first token, 64 tokens decoded after a 16-token
  prompt (three requests, the median; before 2026-12-07's last runs, one request), and forwards of
  one sequence verifying w - 1 drafts after 512 tokens, w = 1..9.

Random weights make the text meaningless but every byte is read and every kernel runs as with
the real model; speed is all this measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests")]

# Qwen3.5-0.8B's text_config (the published config.json)
SHAPES = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
              num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
              linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=262144,
              rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None, eos_token_id=248044,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True})


# Qwen3.5-35B-A3B's text shapes: transformers' Qwen3_5MoeTextConfig defaults, documented as that
# model's (hidden 2048, 40 layers, 256 experts of width 512, 8 per token, a shared expert of 512,
# 16 / 32 DeltaNet key / value heads); --layers keeps the first N layers (every 4th full attention)
MOE_SHAPES = dict(vocab_size=248320, eos_token_id=248044, bos_token_id=None, full_attention_interval=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                   "mrope_section": [11, 11, 10], "mrope_interleaved": True})
MODELS = {"0.8b": "qwen35-0.8b-random", "35b-a3b": "qwen35-35b-a3b-random"}


def hf_config(model: str, layers: int | None):
    import transformers

    if model == "0.8b":
        cfg = transformers.Qwen3_5TextConfig(**SHAPES)
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(**MOE_SHAPES)
    if layers:
        cfg.num_hidden_layers, cfg.layer_types = layers, cfg.layer_types[:layers]
    return cfg


def random_checkpoint(out: Path, model: str = "0.8b", layers: int | None = None) -> Path:
    """Random bf16 weights under the names and shapes of transformers' model (a meta-device model
    gives them; a mixture of experts' 3-D tensors saved one expert at a time, as checkpoints are)."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tiny_models import write_byte_tokenizer

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(model, layers)
    cls = transformers.Qwen3_5ForCausalLM if model == "0.8b" else transformers.Qwen3_5MoeForCausalLM
    with torch.device("meta"):
        hf = cls(cfg)
    mtp = model == "0.8b"  # (the MoE's MTP layer would add 256 more experts the benchmark never reads)
    tensors = random_tensors(hf, hf if mtp else None, torch.Generator().manual_seed(0))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.architectures, cfg.mtp_num_hidden_layers = [cls.__name__], int(mtp)
    cfg.save_pretrained(out)
    write_byte_tokenizer(out, (("Ġ", "t"),))
    return out


def random_tensors(hf, text, g) -> dict:
    """Random bf16 tensors for every parameter of hf (a meta-device model) and the MTP layer of its
    text model ``text`` (an object with .config and .model.layers; None: no MTP layer): norms near their neutral value,
    decays in a realistic range, matrices scaled by their fan-in."""
    import torch
    from tiny_models import mtp_shapes

    tensors = {}
    for name, p in hf.named_parameters():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors.update(random_experts(name, tuple(p.shape), g))
            continue
        r = torch.randn(tuple(p.shape), generator=g)
        if name.endswith("linear_attn.norm.weight") or ("visual" in name and name.endswith("norm1.weight")) or \
                ("visual" in name and name.endswith("norm2.weight")) or name.endswith("merger.norm.weight"):
            r = 1.0 + 0.1 * r  # weights around 1 (the vision tower's LayerNorms, the DeltaNet's gated norm)
        elif "norm" in name:
            r = 0.1 * r  # zero-centred (1 + w) norms, and LayerNorm biases
        elif name.endswith("A_log"):
            r = torch.log(torch.rand(tuple(p.shape), generator=g) * 15 + 1)
        elif p.dim() >= 2:
            r = r * p[0].numel() ** -0.5
        tensors[name] = r.to(torch.bfloat16).contiguous()
    for name, shape in (mtp_shapes(text) if text is not None else {}).items():  # as the released checkpoint has
        r = torch.randn(shape, generator=g)
        tensors[name] = (0.1 * r if "norm" in name else r * shape[-1] ** -0.5).to(torch.bfloat16)
    return tensors


def random_experts(name: str, shape: tuple[int, ...], g) -> dict:
    """One gate / up / down tensor per expert (checkpoints' names) for transformers' 3-D parameter."""
    import torch

    layer, part = name.rsplit(".mlp.experts.", 1)
    out = {}
    for e in range(shape[0]):
        w = (torch.randn(shape[1:], generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)
        if part == "gate_up_proj":
            gate, up = w.chunk(2)
            out[f"{layer}.mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
            out[f"{layer}.mlp.experts.{e}.up_proj.weight"] = up.contiguous()
        else:
            out[f"{layer}.mlp.experts.{e}.down_proj.weight"] = w
    return out


def gguf_files(ckpt: Path, types: list[str], top: Path) -> dict[str, Path]:
    from native_llamacpp import build_native, native_dir, native_tool

    build_native()  # (its source tree holds the converter)
    src = native_dir() / "src"
    q8 = top / f"{top.name}-q8_0.gguf"
    if not q8.exists():
        sys.path[:0] = [str(HERE.parent / "tests" / "data")]
        from make_tiny_qwen35 import convert_cmd

        mtp = json.loads((ckpt / "config.json").read_text()).get("mtp_num_hidden_layers")
        subprocess.run(convert_cmd(src, ckpt, q8, "q8_0", *([] if mtp else ["--no-mtp"])), check=True)
    out = {"q8_0": q8}
    if "q4_k_m" in types:
        q4 = top / f"{top.name}-q4_k_m.gguf"
        if not q4.exists():
            subprocess.run([str(native_tool("llama-quantize")), "--allow-requantize", str(q8), str(q4), "Q4_K_M"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out["q4_k_m"] = q4
    return {t: out[t] for t in types}


def llama_cpp(bench: Path, gguf: Path, prefill: list[int], decode: int, widths: list[int]) -> dict:
    from native_llamacpp import llama_bench_rows

    rows = llama_bench_rows(bench, gguf, "-p", ",".join(map(str, prefill)), "-n", str(decode))
    rows += llama_bench_rows(bench, gguf, "-p", ",".join(map(str, widths)), "-n", "0")
    out = {"prefill_tok_s": {}, "width_s": {}}
    for r in rows:
        if r["n_gen"]:
            out["decode_tok_s"] = r["avg_ts"]
        elif r["n_prompt"] in prefill and r["n_prompt"] not in out["prefill_tok_s"]:
            out["prefill_tok_s"][r["n_prompt"]] = r["avg_ts"]
        if not r["n_gen"] and r["n_prompt"] in widths:
            out["width_s"][r["n_prompt"]] = r["n_prompt"] / r["avg_ts"]
    return out


def specserve(gguf: Path, prefill: list[int], decode: int, widths: list[int]) -> dict:
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.engine.scheduler import ScheduledRow
    from specserve.engine.types import SamplingParams
    from specserve.models.loader import load_model
    from specserve.speculative.config import SpeculativeConfig

    target = load_model(str(gguf))
    out = {"prefill_tok_s": {}, "width_s": {}}
    vocab = target.config.vocab_size

    def ids(start: int, n: int) -> list[int]:
        return [(start + 7 * i) % vocab for i in range(n)]

    # room for max(widths) - 1 drafts per step (snapshot planes), no drafter: plain decoding
    room = SpeculativeConfig("ngram", num_speculative_tokens=max(widths) - 1, adaptive=False)
    eng = LLMEngine(target, EngineConfig(max_model_len=max(max(prefill), 512) + 64, max_num_seqs=2, max_step_ms=0,
                                         enable_prefix_caching=False), room)
    for n in prefill:
        t0 = time.perf_counter()
        list(eng.generate(ids(1000, n), SamplingParams(max_tokens=1), request_id=f"p{n}"))
        out["prefill_tok_s"][n] = n / (time.perf_counter() - t0)
    rates = []
    for r in range(3):  # three requests, the median (llama-bench averages its repetitions)
        t0, got = None, 0
        for o in eng.generate(ids(2000 + r, 16), SamplingParams(max_tokens=decode + 1, ignore_eos=True),
                              request_id=f"d{r}"):
            got += len(o.new_token_ids)
            if t0 is None:
                t0, first = time.perf_counter(), got
        rates.append((got - first) / (time.perf_counter() - t0))
    out["decode_tok_s"], out["decode_rounds_tok_s"] = statistics.median(rates), rates
    # forwards of one sequence verifying w - 1 drafts after 512 tokens (its state and KV stay put)
    eng.add_request("w", ids(3000, 512), SamplingParams(max_tokens=8, ignore_eos=True))
    seq = eng.by_id["w"]
    while seq.num_computed < 512:
        eng.step()
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(3):
        for w in widths:
            eng.scheduler.reserve(seq, seq.num_computed + w)
            row = ScheduledRow(seq, 0, w, True, num_drafts=w - 1, drafts=[5] * (w - 1))
            t = time.perf_counter()
            eng.runner.run([row], timed=False)
            times[w].append(time.perf_counter() - t)
            eng.cache.rollback(seq)  # back to the committed state: nothing was accepted
    out["width_s"] = {w: statistics.median(ts) for w, ts in times.items()}
    eng.abort("w")
    return out


def markdown(res: dict, cpu: str) -> str:
    shapes = {"0.8b": "Qwen3.5-0.8B's shapes", "35b-a3b": "Qwen3.5-35B-A3B's shapes"}[res.get("model", "0.8b")]
    if res.get("layers"):
        shapes += f", its first {res['layers']} layers"
    lines = [f"CPU: {cpu}, 2 threads. Random weights at {shapes}; the same GGUF file for both.", "",
             "| file | engine | decode tok/s | " + "".join(f"prefill {n // 1024}K tok/s | " for n in res["prefill"])
             + " | ".join(f"t({w})/t(1)" for w in res["widths"][1:]) + " |",
             "|---|---|---|" + "---|" * len(res["prefill"]) + "---|" * (len(res["widths"]) - 1)]
    for t, by in res["files"].items():
        for eng in ("llama.cpp", "specserve"):
            r = by[eng]
            pf = [f"{r['prefill_tok_s'].get(n, float('nan')):.0f}" for n in res["prefill"]]
            ws = r["width_s"]
            ratios = [f"{ws[w] / ws[1]:.2f}" for w in res["widths"][1:]]
            lines.append(f"| {t} | {eng} | {r['decode_tok_s']:.1f} | " + " | ".join(pf) + " | " + " | ".join(ratios)
                         + " |")
        ratio = by["specserve"]["decode_tok_s"] / by["llama.cpp"]["decode_tok_s"]
        lines.append(f"| {t} | specserve / llama.cpp | {ratio:.2f}x | "
                     + " | ".join(f"{by['specserve']['prefill_tok_s'][n] / by['llama.cpp']['prefill_tok_s'][n]:.2f}x"
                                  for n in res["prefill"]) + " |" + " |" * (len(res["widths"]) - 1))
    return "\n".join(lines) + "\n"


def main() -> None:
    from native_llamacpp import build_native

    from specserve.models.catalog import cache_root

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="q8_0,q4_k_m")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--widths", default="1-9")
    ap.add_argument("--out")
    ap.add_argument("--markdown")
    ap.add_argument("--model", choices=list(MODELS), default="0.8b",
                    help="whose shapes: Qwen3.5-0.8B (dense) or Qwen3.5-35B-A3B (mixture of experts)")
    ap.add_argument("--layers", type=int, help="keep the first N layers (the 35B-A3B's 40 do not fit 24 GB)")
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.widths.split("-"))
    widths, prefill = list(range(lo, hi + 1)), [int(x) for x in a.prefill.split(",")]
    top = cache_root() / "bench" / (MODELS[a.model] + (f"-{a.layers}l" if a.layers else ""))
    files = gguf_files(random_checkpoint(top / "hf", a.model, a.layers), a.types.split(","), top)
    bench = build_native() / "llama-bench"
    res = {"prefill": prefill, "widths": widths, "files": {}, "model": a.model, "layers": a.layers}
    for t, f in files.items():
        print(f"{t}: llama.cpp", file=sys.stderr, flush=True)
        ref = llama_cpp(bench, f, prefill, a.decode, widths)
        print(f"{t}: specserve", file=sys.stderr, flush=True)
        res["files"][t] = {"llama.cpp": ref, "specserve": specserve(f, prefill, a.decode, widths)}
        print(json.dumps(res["files"][t]), file=sys.stderr, flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    res["cpu"] = cpu
    md = markdown(res, cpu)
    print(md)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    if a.markdown:
        Path(a.markdown).write_text(md)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
