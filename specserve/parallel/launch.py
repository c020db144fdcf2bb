"""Start a tensor-parallel group: flags, one worker process per local rank, the rendezvous.

``--tensor-parallel-size N`` (``-tp``) on one machine: ``specserve serve`` is rank 0 (the
driver: HTTP, scheduler, sampler, drafters) and starts ranks 1..N-1 as worker processes of its
own (``python -m specserve.parallel.worker``). Over several machines (``--nnodes``,
``--node-rank``, ``--dist-init-addr host:port``, SGLang's flags) each node runs the same
command; node k hosts ranks k*N/nnodes .. (k+1)*N/nnodes-1, node 0's first rank is the driver,
and the rendezvous store listens on node 0 at --dist-init-addr. Under torchrun the same
numbers are --nnodes, --node-rank, --master-addr:--master-port with --nproc-per-node N/nnodes,
except that specserve starts its worker processes itself.

A watchdog thread on the driver polls the local workers: one that exits, or a call into the
target in flight for twice ``--dist-timeout`` (a rank that hangs), breaks the group (every later
collective raises, naming the rank), and the process exits non-zero within ``--dist-timeout``
seconds more instead of hanging. Between calls nothing times out: a worker waits for the next
call as long as the server idles.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from specserve.errors import SpecserveError
from specserve.parallel.group import TensorParallel

log = logging.getLogger("specserve.parallel")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of the rendezvous (node 0); None: a free local port
    dist_timeout: float = 30.0  # seconds any collective may wait before the group counts as broken

    def __post_init__(self) -> None:
        n = self.tensor_parallel_size
        if n < 1:
            raise SpecserveError(f"--tensor-parallel-size must be >= 1, got {n}")
        if self.nnodes < 1:
            raise SpecserveError(f"--nnodes must be >= 1, got {self.nnodes}")
        if n % self.nnodes:
            raise SpecserveError(f"--nnodes {self.nnodes} must divide --tensor-parallel-size {n}")
        if not 0 <= self.node_rank < self.nnodes:
            raise SpecserveError(f"--node-rank must be in [0, {self.nnodes - 1}], got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise SpecserveError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address)")
        if self.dist_init_addr:
            host_port(self.dist_init_addr)
        if not 0 < self.dist_timeout < float("inf"):
            raise SpecserveError(f"--dist-timeout must be a positive number of seconds, got {self.dist_timeout}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ParallelConfig":
        return cls(getattr(args, "tensor_parallel_size", 1), getattr(args, "nnodes", 1),
                   getattr(args, "node_rank", 0), getattr(args, "dist_init_addr", None),
                   getattr(args, "dist_timeout", 30.0))

    @property
    def local_ranks(self) -> range:
        per = self.tensor_parallel_size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def threads_per_rank(self, threads: int | None) -> int:
        """--threads (per rank), else this machine's cores shared by its ranks."""
        return threads or max(1, len(os.sched_getaffinity(0)) // len(self.local_ranks))

    def core_sets(self) -> dict[int, list[int]]:
        """Each local rank's own cores (an even split of the cores this process may use), or {}
        when there are fewer cores than ranks. Pinned ranks do not take each other's cores while
        one waits in a collective (2 ranks on 2 cores: the waits per token halve)."""
        cores = sorted(os.sched_getaffinity(0))
        ranks = list(self.local_ranks)
        if len(cores) < len(ranks):
            return {}
        per = len(cores) // len(ranks)
        return {r: cores[i * per:(i + 1) * per] for i, r in enumerate(ranks)}


def ranks_sharing_memory(local_ranks: int, device) -> int:
    """How many of a machine's ranks plan from one pool of memory: all of them on the CPU, the
    ranks that share a GPU on CUDA (rank r takes GPU r % GPUs)."""
    if device.type == "cuda":
        import torch

        return -(-local_ranks // torch.cuda.device_count())
    return local_ranks


def pin(cores: list[int] | None) -> None:
    if cores:
        os.sched_setaffinity(0, cores)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks one model is split over (one process each; gloo on the CPU, NCCL "
                        "between GPUs)")
    p.add_argument("--nnodes", type=int, default=1, help="machines the ranks are spread over")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index among --nnodes")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="node 0's rendezvous address (default on one machine: a free local port)")
    p.add_argument("--dist-timeout", type=float, default=30.0,
                   help="seconds a collective may wait before the group counts as broken and the server exits")


def host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecserveError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def worker_argv(args: argparse.Namespace, rank: int, pcfg: ParallelConfig, addr: str, threads: int) -> list[str]:
    """A worker's command line: which shard to load, where to meet, how long to wait."""
    return [sys.executable, "-m", "specserve.parallel.worker", "--rank", str(rank),
            "--world", str(pcfg.tensor_parallel_size), "--dist-init-addr", addr,
            "--dist-timeout", str(pcfg.dist_timeout), "--threads", str(threads),
            "--cpus", ",".join(map(str, pcfg.core_sets().get(rank, []))), "--model", args.model,
            "--device", args.device, "--dtype", args.dtype, "--quantization", args.quantization]


def start_workers(args: argparse.Namespace, pcfg: ParallelConfig, addr: str) -> dict[int, subprocess.Popen]:
    """This node's worker processes (every local rank but the driver's), loading in parallel."""
    threads = pcfg.threads_per_rank(getattr(args, "threads", None))
    procs = {}
    for rank in pcfg.local_ranks:
        if rank == 0:
            continue
        procs[rank] = subprocess.Popen(worker_argv(args, rank, pcfg, addr, threads))
        log.info("tensor-parallel rank %d: worker pid %d", rank, procs[rank].pid)
    return procs


def connect(rank: int, pcfg: ParallelConfig, addr: str, procs: dict[int, subprocess.Popen],
            device=None) -> TensorParallel:
    """Join the group (device: this rank's model device); while waiting, a local worker that
    exits fails the start-up, naming it."""
    host, port = host_port(addr)
    box: dict = {}

    def run():
        try:
            box["tp"] = TensorParallel.connect(rank, pcfg.tensor_parallel_size, host, port, pcfg.dist_timeout,
                                               device=device)
        except Exception as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    t = threading.Thread(target=run, name="specserve-tp-connect", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
        for r, p in procs.items():
            if p.poll() is not None:
                raise SpecserveError(f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.returncode} "
                                     "before the group formed (its error is above)")
    if "error" in box:
        raise SpecserveError(f"tensor-parallel rendezvous at {addr} failed: {box['error']}") from box["error"]
    tp = box["tp"]
    tp.processes = procs
    return tp


def watch(tp: TensorParallel, interval_s: float = 0.2) -> threading.Thread:
    """Driver: a thread that breaks the group when a local worker exits, and ends this process
    (code 1) when it is still running ``--dist-timeout`` seconds later (a step stuck in a
    collective with a rank on another machine)."""
    def run():
        while tp.failed is None:
            if tp.closing:
                return
            dead = [(r, p) for r, p in tp.processes.items() if p.poll() is not None]
            busy = tp.busy_since
            if dead:
                r, p = dead[0]
                tp.fail(f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.returncode}")
            elif busy is not None and time.monotonic() - busy > 2 * tp.timeout_s:
                tp.fail(f"a tensor-parallel call has waited {2 * tp.timeout_s:g} s (a rank hangs)")
            if tp.failed is not None:
                log.error("%s: the group is broken, failing the requests in flight", tp.failed)
                break
            time.sleep(interval_s)
        deadline = time.monotonic() + tp.timeout_s + 5
        while time.monotonic() < deadline:
            if tp.closing:
                return
            time.sleep(0.5)
        log.error("tensor-parallel group broken (%s) and the process is still up: exiting", tp.failed)
        stop_workers(tp)
        os._exit(1)

    t = threading.Thread(target=run, name="specserve-tp-watchdog", daemon=True)
    t.start()
    return t


def stop_workers(tp: TensorParallel, wait_s: float = 5.0) -> None:
    """Driver: ask the workers to exit, then make sure they have."""
    tp.stop()
    deadline = time.monotonic() + wait_s
    for p in tp.processes.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_node(args: argparse.Namespace, pcfg: ParallelConfig) -> int:
    """``serve --node-rank K`` (K > 0): this machine's ranks only, no HTTP; ends when they do
    (the driver stops them, or the group breaks), non-zero when any of them failed."""
    procs = start_workers(args, pcfg, pcfg.dist_init_addr)
    log.info("node %d of %d: ranks %s, waiting for the driver at %s", pcfg.node_rank, pcfg.nnodes,
             list(pcfg.local_ranks), pcfg.dist_init_addr)
    try:
        codes = [p.wait() for p in procs.values()]
    except KeyboardInterrupt:
        for p in procs.values():
            p.terminate()
        codes = [p.wait() for p in procs.values()]
    return max(codes, default=0)
