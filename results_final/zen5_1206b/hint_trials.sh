#!/bin/sh
# What a fresh engine's prefetch-hint trial chooses over its first real decode steps, in five
# processes one after the other (qwen2.5-coder-1.5b, plain, one 128-token greedy answer each):
# the engine's log line. sh results_final/zen5_1206b/hint_trials.sh
for i in 1 2 3 4 5; do
  python -c "
import argparse, logging, sys
logging.basicConfig(level=logging.INFO, format='%(message)s')
sys.path[:0] = ['benchmarks']
import spec_decode as sd
eng = sd.make_engines('qwen2.5-coder-1.5b', [('plain', None)], argparse.Namespace(quantization='auto', ctx=4096, threads=None))['plain']
sd.run_one(eng, eng.tokenizer.encode('Write a Python function that merges two sorted lists.'), 128)
" 2>&1 | grep "weight prefetch"
done
