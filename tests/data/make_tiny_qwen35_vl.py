"""Make the committed llama.cpp mmproj of the vision tower tests (tests/test_vision_tower.py).

    python tests/data/make_tiny_qwen35_vl.py

1. the tiny random Qwen3.5 image-text checkpoint of tests/tiny_models.py (``make_tiny_vl``, seed 0)
   is saved under tests/data/tiny_qwen35_vl/hf;
2. llama.cpp's own ``convert_hf_to_gguf.py --mmproj`` (from the llama-cpp-python sdist the native
   benchmark unpacks; no build needed) converts its ``model.visual.*`` tower to an F32 and a Q8_0
   mmproj GGUF (projector type qwen3vl_merger) beside it, and its text model to an F32 GGUF;
The tests load the tower from both the checkpoint and the mmproj files and compare them, and
serve images with the text GGUF plus ``--mmproj`` (tests/test_vision.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks"), str(HERE)]

OUT = HERE / "tiny_qwen35_vl"
OUTTYPES = ("f32", "q8_0")


def mmproj_path(outtype: str) -> Path:
    return OUT / f"mmproj-tiny-qwen35-vl-{outtype}.gguf"


def main() -> None:
    from make_tiny_qwen35 import convert
    from native_llamacpp import native_dir
    from tiny_models import make_tiny_vl

    src = native_dir() / "src"
    if not (src / "convert_hf_to_gguf.py").exists():
        sys.exit(f"llama.cpp's source is not at {src}: run benchmarks/native_llamacpp.py once to unpack it")
    make_tiny_vl(OUT / "hf", seed=0)
    for outtype in OUTTYPES:
        print(convert(src, outtype, OUT / "hf", mmproj_path(outtype), "--mmproj"))
    print(convert(src, "f32", OUT / "hf", OUT / "tiny-qwen35-vl-f32.gguf"))


if __name__ == "__main__":
    main()
