#!/bin/sh
# 2026-12-05, AMD EPYC Zen 4 (family 25 model 17), 2 cores, both engines built for AVX2 alone (what a
# Zen 3 or any AVX2-only x86-64 runs): llama.cpp configured with -DGGML_NATIVE=OFF (no AVX-512, no
# VNNI), ours with SPECSERVE_KERNEL_VARIANT=avx2; one server at a time
D=results_final/avx2_1205
python benchmarks/forward_vs_llamacpp.py --isa avx2 --rounds 2 --out $D/forward_avx2.json --markdown $D/forward_avx2.md
python benchmarks/forward_vs_llamacpp.py --isa avx2 --rounds 4 --models qwen2.5-coder-1.5b \
  --out $D/forward_avx2_qwen1.5b.json --markdown $D/forward_avx2_qwen1.5b.md
# the two builds of our kernels in one process (1 row: the same memory stream; 8 rows: arithmetic)
python benchmarks/decode_cost.py --models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b,smollm2-135m --formats auto \
  --rows 1,8 --context 512 --min-time 3 --variants "native=;avx2=-mno-avx512f" --markdown $D/decode_native_vs_avx2.md
run() {  # model label configs
  python benchmarks/native_llamacpp.py --isa avx2 --model "$1" --tokens 128 --rounds 2 --limit 2 --configs "$3" \
    --out $D/native_$2.json --markdown $D/native_$2.md
}
run smollm2-135m smollm2 "llama.cpp plain,specserve plain,specserve suffix"
run gemma3-270m gemma3 "llama.cpp plain,specserve plain,specserve suffix"
run qwen2.5-coder-0.5b qwen0.5b "llama.cpp plain,specserve plain,specserve suffix"
run qwen2.5-coder-1.5b qwen1.5b "llama.cpp plain,specserve plain,specserve draft q4_0 32K"
# the AVX2 build of llama.cpp holds no AVX-512 (zmm) instruction: 0 per binary
for b in llama-bench llama-server; do
  echo "$b: $(objdump -d "$(python benchmarks/native_llamacpp.py --build-only --isa avx2)/$b" | grep -c zmm) zmm"
done > $D/avx2_no_zmm.txt
