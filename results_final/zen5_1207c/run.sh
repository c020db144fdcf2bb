# 2026-12-07, third session (AMD EPYC Zen 5, family 26 model 2, 2 cores): the commands behind README
# "Long prompts with short answers: the catch-up weighed against answers seen".
set -e
cd "$(dirname "$0")"
python short_answers.py > short_answers.txt
# short_answers_mean.txt was taken with the rule's first version (see its first line); today's equivalent:
# python short_answers.py mean > short_answers_mean.txt
# against native llama-server (native_qwen1.5b.md, native_smollm2.md), from the repository root:
# sh results_final/zen5_1207c/native.sh
# draft_window 128 / 256 / 512 after the four long prompts (spec_window_small.md: 256-token answers;
# spec_window_small_128.md: 128-token answers), from the repository root:
# S='{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 8, "quantization": "q4_0", "draft_vocab_size": 32768'
# for T in 256 128; do python benchmarks/spec_decode.py --models qwen2.5-coder-1.5b \
#   --suites results_final/zen5_1206c/long.jsonl,results_final/zen5_1207/long6k.jsonl --tokens $T --runs 1 \
#   --prompts-per-suite 2 --ctx 8192 --spec "draft window 128=$S, \"draft_window\": 128}" \
#   --spec "draft window 256=$S, \"draft_window\": 256}" --spec "draft window 512=$S, \"draft_window\": 512}" \
#   --out results_final/zen5_1207c/spec_window_small_$T.json --markdown results_final/zen5_1207c/spec_window_small_$T.md; done
