"""A tensor-parallel worker: one rank's shard of the target, running the driver's calls.

Started by the driver (parallel/launch.py), never by hand. It loads its shard, joins the group,
allocates its slice of the KV pool when the driver sends the memory plan, then runs every call
the driver makes (forward, embed, logits, a cut of the LM head, the prefetch hint) until told to stop. It exits non-zero when the group
breaks (the driver died, a collective timed out), so nothing is left running.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import torch

from specserve.errors import SpecserveError

log = logging.getLogger("specserve.parallel")


def parse(argv: list[str]) -> argparse.Namespace:
    from specserve.commands.args import add_model_args

    p = argparse.ArgumentParser(prog="python -m specserve.parallel.worker")
    add_model_args(p)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--dist-init-addr", required=True)
    p.add_argument("--dist-timeout", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpus", default="", help="cores to pin this rank to (comma-separated; empty: none)")
    return p.parse_args(argv)


def allocate_kv(model, plan: list[int]):
    """The KV slice the driver's plan asks for, or None when it does not fit this rank's memory."""
    from specserve.engine.config import available_memory
    from specserve.models.kv_cache import KV_DTYPES, KVCache

    num_blocks, block_size, window_blocks, dtype, slots, planes, checkpoints = plan
    kv = KVCache.allocate(model.cfg, num_blocks, block_size, KV_DTYPES[dtype], model.device,
                          window_blocks=window_blocks or None)
    need = kv.nbytes()
    if model.cfg.hybrid:  # this rank's heads of the linear-attention layers' states
        from specserve.models.hybrid import RecurrentStates

        kv.states = RecurrentStates.allocate(model.cfg, slots, planes, model.device, checkpoints)
        need += kv.states.nbytes()
    return kv if need <= available_memory(model.device) else None


def serve(model, tp) -> int:
    """Run the driver's calls until STOP (0) or the group breaks (1)."""
    from specserve.kernels.library import set_prefetch_t0
    from specserve.models.transformer import ForwardBatch
    from specserve.parallel.group import Op, ParallelError

    kv = None
    try:
        while True:
            op, t = tp.receive(model.device)
            if op == Op.FORWARD:
                model.forward(ForwardBatch.from_tensors(t), kv)
            elif op == Op.EMBED:
                model.embed(t[0])
            elif op == Op.LOGITS:  # [h, the cut's key or None]
                model.logits(t[0], None if t[1] is None else model.head_cuts[int(t[1])])
            elif op == Op.CUT_HEAD:  # [(key, key dropped or -1), ids]
                key, drop = t[0].tolist()
                model.cut_head(t[1], model.head_cuts.get(drop), key)
            elif op == Op.HINT:
                set_prefetch_t0(bool(t[0].item()))
            elif op == Op.INIT_KV:
                kv = allocate_kv(model, t[0].tolist())
                tp.max_flag(0 if kv is not None else tp.rank + 1)
            elif op == Op.STOP:
                return 0
    except ParallelError as exc:
        log.error("rank %d: %s; exiting", tp.rank, exc)
        return 1


def main(argv: list[str] | None = None) -> int:
    from specserve.commands.serve import _setup_logging
    from specserve.engine.builder import set_threads
    from specserve.models.loader import LoadOptions, load_model
    from specserve.parallel.launch import ParallelConfig, connect, pin
    from specserve.parallel.shard import Shard

    args = parse(sys.argv[1:] if argv is None else argv)
    # Ctrl-C reaches the whole process group: the driver drains and then stops this worker itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _setup_logging("info")
    pin([int(c) for c in args.cpus.split(",") if c])
    set_threads(args.threads)
    try:
        shard = Shard(args.rank, args.world)
        target = load_model(args.model, LoadOptions(args.device, args.dtype, args.quantization, shard=shard,
                                                        vision=False))
        pcfg = ParallelConfig(args.world, 1, 0, args.dist_init_addr, args.dist_timeout)
        tp = connect(args.rank, pcfg, args.dist_init_addr, {}, target.model.device)
    except SpecserveError as exc:
        print(f"specserve tensor-parallel rank {args.rank}: error: {exc}", file=sys.stderr)
        return 2
    target.model.attach_tensor_parallel(tp)
    with torch.inference_mode():
        return serve(target.model, tp)


if __name__ == "__main__":
    sys.exit(main())
