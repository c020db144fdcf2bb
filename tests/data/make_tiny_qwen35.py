"""Make the committed llama.cpp oracle of the hybrid model tests (tests/test_hybrid_gguf.py).

    python tests/data/make_tiny_qwen35.py [qwen35 | qwen3next | qwen35moe ...]   (default: all)

1. the tiny random Qwen3.5 checkpoint of tests/tiny_models.py (its mtp.* tensors included) is
   saved under tests/data/tiny_qwen35/hf (a tiny Qwen3-Next under next_hf, a Qwen3.5-MoE under moe_hf);
2. llama.cpp's own ``convert_hf_to_gguf.py`` (from the llama-cpp-python sdist, the source the
   native benchmark builds) converts it to F32 and Q8_0 GGUF, MTP head included; its tokenizer
   pre-tokenizer check does not know the tests' byte-level vocabulary, so the conversion declares
   it 'qwen2' (only token ids are compared);
3. native ``llama-server`` (benchmarks/native_llamacpp.py builds it) generates 32 greedy tokens
   for each prompt of token ids on each file, or fewer when it stops at the end-of-text token
   (its ``ignore_eos`` would forbid that token, which changes the greedy path); they go into
   llama_cpp_tokens.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

OUT = HERE / "tiny_qwen35"
PROMPTS = [[(7 * i + 3 * j * j) % 256 for j in range(12 + 9 * i)] for i in range(4)]
TOKENS = 32


def convert_cmd(src: Path, ckpt: Path, out: Path, outtype: str, *extra: str) -> list[str]:
    """The command running llama.cpp's converter (source tree src) on ckpt, with the test vocabulary's
    pre-tokenizer declared 'qwen2'; ``extra``: more converter flags (a checkpoint without an MTP
    layer needs --no-mtp)."""
    argv = ["convert_hf_to_gguf.py", str(ckpt), "--outfile", str(out), "--outtype", outtype, *extra]
    code = (f"import runpy, sys; sys.path[:0] = [{str(src)!r}, {str(src / 'gguf-py')!r}]\n"
            "import conversion.base as b\n"
            "for c in vars(b).values():\n"
            "    if isinstance(c, type) and hasattr(c, 'get_vocab_base_pre'):\n"
            "        c.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
            f"sys.argv = {argv!r}\n"
            f"runpy.run_path({str(src / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    return [sys.executable, "-c", code]


def convert(src: Path, outtype: str, ckpt: Path = OUT / "hf", out: Path | None = None, *extra: str) -> Path:
    out = out or OUT / f"tiny-qwen35-{outtype}.gguf"
    subprocess.run(convert_cmd(src, ckpt, out, outtype, *extra), check=True)
    return out


def llama_cpp_tokens(server: Path, gguf: Path) -> list[list[int]]:
    from specserve.bench.serverproc import free_port

    port = free_port()
    proc = subprocess.Popen([str(server), "-m", str(gguf), "--port", str(port), "-t", "2", "-c", "1024",
                             "--no-warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            for _ in range(120):
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            out = []
            for p in PROMPTS:
                r = http.post("/completion", json={"prompt": p, "n_predict": TOKENS, "temperature": 0.0,
                                                   "top_k": 1, "cache_prompt": False,
                                                   "return_tokens": True})
                r.raise_for_status()
                out.append(r.json()["tokens"])
            return out
    finally:
        proc.terminate()
        proc.wait(30)


def make(kind: str, src: Path) -> list[Path]:
    """The checkpoint of one kind under OUT and its GGUF files."""
    from native_llamacpp import native_tool
    from tiny_models import make_tiny_hybrid, make_tiny_qwen3_5_moe, make_tiny_qwen3_next

    if kind == "qwen35":
        make_tiny_hybrid(OUT / "hf")
        return [convert(src, outtype) for outtype in ("f32", "q8_0")]
    if kind == "qwen3next":
        # every MLP sparse (llama.cpp's converter rejects dense layers), its MTP head a mixture-of-experts
        # layer too (GGUF: experts merged into 3-D tensors, ssm_ba interleaved per key head)
        make_tiny_qwen3_next(OUT / "next_hf", mtp=True, mlp_only_layers=[])
        return [convert(src, "f32", OUT / "next_hf", OUT / "tiny-qwen3next-f32.gguf")]
    # Qwen3.5-MoE: Qwen3.5's tiled value heads, experts merged into 3-D tensors, a MoE MTP head; and
    # llama-quantize's Q8_0 of it, where the shared expert's gate [1, H] is written as a vector [H]
    make_tiny_qwen3_5_moe(OUT / "moe_hf")
    f32 = convert(src, "f32", OUT / "moe_hf", OUT / "tiny-qwen35moe-f32.gguf")
    q8 = OUT / "tiny-qwen35moe-q8_0.gguf"
    subprocess.run([str(native_tool("llama-quantize")), str(f32), str(q8), "Q8_0"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [f32, q8]


def main(kinds: list[str]) -> None:
    """Remake the kinds named (default: all) and their tokens; the others' records are kept."""
    from native_llamacpp import build_native, native_dir

    bindir = build_native()
    src = native_dir() / "src"
    path = OUT / "llama_cpp_tokens.json"
    old = json.loads(path.read_text()) if path.exists() else {"files": {}}
    record = {"prompts": PROMPTS, "tokens": TOKENS, "llama_cpp": str(native_dir().name), "files": old["files"]}
    for kind in kinds or KINDS:
        for gguf in make(kind, src):
            record["files"][gguf.name] = llama_cpp_tokens(bindir / "llama-server", gguf)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["files"], indent=1))


KINDS = ("qwen35", "qwen3next", "qwen35moe")


if __name__ == "__main__":
    main(sys.argv[1:])
