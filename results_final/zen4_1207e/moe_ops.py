"""Where one decode step of the 4-layer Qwen3.5-35B-A3B-shaped model goes, op by op (torch's
profiler, self CPU time; it adds a little to every op, so read shares and op counts, not absolute
speed), and the step's wall time without the profiler. The file: hybrid_speed.py --model 35b-a3b
--layers 4.

    python results_final/zen4_1207e/moe_ops.py > results_final/zen4_1207e/moe_ops_LABEL.txt
"""

import time

from torch.profiler import ProfilerActivity, profile

from moe_model import decoding_engine


def main() -> None:
    _, eng = decoding_engine(max_model_len=512, max_tokens=400)
    steps = []
    for _ in range(5):  # wall time: medians of 5 turns of 20 steps
        t0 = time.perf_counter()
        for _ in range(20):
            eng.step()
        steps.append((time.perf_counter() - t0) / 20 * 1e3)
    print(f"decode step, median of 5 x 20 steps: {sorted(steps)[2]:.2f} ms (all: "
          + ", ".join(f"{s:.2f}" for s in steps) + ")")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            eng.step()
    print("profiled 20 steps; per step below")
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{'op':40s} {'calls/step':>10s} {'self ms/step':>12s} {'share':>6s}")
    for e in events[:30]:
        print(f"{e.key[:40]:40s} {e.count / 20:10.1f} {e.self_cpu_time_total / 20 / 1e3:12.3f} "
              f"{e.self_cpu_time_total / total:6.1%}")
    print(f"ops per step {sum(e.count for e in events) / 20:.0f}; self time per step {total / 20 / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
