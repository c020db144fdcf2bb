# 2026-12-07, third session (AMD EPYC Zen 5, family 26 model 2, 2 cores): the commands behind README
# "Long prompts with short answers: the catch-up weighed against answers seen".
set -e
cd "$(dirname "$0")"
python short_answers.py > short_answers.txt
# short_answers_mean.txt was taken with the rule's first version (see its first line); today's equivalent:
# python short_answers.py mean > short_answers_mean.txt
# against native llama-server (native_qwen1.5b.md, native_smollm2.md), from the repository root:
# sh results_final/zen5_1207c/native.sh
