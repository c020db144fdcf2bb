#!/bin/sh
# What a fresh engine's start-up timing of the prefetch hint sees, in five processes one after the
# other (qwen2.5-coder-1.5b, plain): the engine's log line. sh results_final/zen5_1206/prefetch_starts.sh
# (at c3a7b94: adb7d92 replaced the start-up timing by a trial over the first real forwards, so at later
# commits it prints nothing; results_final/zen5_1206b/hint_trials.sh is its successor)
for i in 1 2 3 4 5; do
  python -c "
import argparse, logging, sys
logging.basicConfig(level=logging.INFO, format='%(message)s')
sys.path[:0] = ['benchmarks']
import spec_decode as sd
sd.make_engines('qwen2.5-coder-1.5b', [('plain', None)], argparse.Namespace(quantization='auto', ctx=4096, threads=None))
" 2>&1 | grep "weight prefetch"
done
