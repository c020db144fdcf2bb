"""Eight Q4_K matrices of one expert's gate|up shape [1024 x 2048], drawn from a pool of 64 as a token's
experts are, read from memory (64 MB written between reps) for one row: one call each, one grouped
call (kernels/grouped.py), then the same with the pool copied into one huge-page mapping; against
one [8192 x 2048] matrix of the same bytes. Medians of 15 reps; ms and GB/s.

    python results_final/zen4_1207d/expert_stream.py > results_final/zen4_1207d/expert_stream.txt
"""
import time, statistics, torch, sys
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2] / 'tests'))
from kernel_utils import raw_blocks
from specserve.kernels import ops
from specserve.kernels.grouped import linear_group
def mk(n, k, count): return [ops.GGUFBlockWeight.from_raw(raw_blocks("Q4_K", n, k, seed=s), "Q4_K", n, k) for s in range(count)]
flush = torch.empty(64 << 20, dtype=torch.uint8)
def cold(f, reps=15):
    ts = []
    for _ in range(reps):
        flush.add_(1)  # 64 MB through the caches
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
x = torch.randn(1, 2048)
# 8 experts' gate|up (1024 x 2048) from a pool of 64, as a token's would be
pool = mk(1024, 2048, 64)
big = mk(8192, 2048, 1)[0]
nb = pool[0].nbytes
import random
rnd = random.Random(0)
def eight_separate():
    for w in rnd.sample(pool, 8): ops.linear(x, w)
def eight_grouped():
    ws = rnd.sample(pool, 8); linear_group([x]*8, ws, torch.empty(8, 1024))
t_sep, t_grp, t_big = cold(eight_separate), cold(eight_grouped), cold(lambda: ops.linear(x, big))
print(f"8 x [1024 x 2048] Q4_K ({8*nb/1e6:.1f} MB): separate {t_sep*1e3:.3f} ms ({8*nb/t_sep/1e9:.1f} GB/s), grouped {t_grp*1e3:.3f} ms ({8*nb/t_grp/1e9:.1f} GB/s); one [8192 x 2048] ({big.nbytes/1e6:.1f} MB) {t_big*1e3:.3f} ms ({big.nbytes/t_big/1e9:.1f} GB/s)")
from specserve.kernels.hostmem import anon_bytes
sizes = [-(-w.packed.numel() // 64) * 64 for w in pool]
arena, at = anon_bytes(sum(sizes)), 0
for w, s in zip(pool, sizes):
    n = w.packed.numel(); arena[at:at+n].copy_(w.packed); w.packed = arena[at:at+n]; at += s
t_sep, t_grp = cold(eight_separate), cold(eight_grouped)
print(f"the same in one huge-page mapping: separate {t_sep*1e3:.3f} ms ({8*nb/t_sep/1e9:.1f} GB/s), grouped {t_grp*1e3:.3f} ms ({8*nb/t_grp/1e9:.1f} GB/s)")
