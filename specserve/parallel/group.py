"""One tensor-parallel group: its collectives, and the driver's calls mirrored on every rank.

Rank 0 (the driver) runs the scheduler, the sampler, verification and the drafters; every rank
holds a shard of the target. Each call the driver makes into the target (``forward``, ``embed``,
``logits``) is first broadcast as an operation with its tensors (``lead``), so the workers run
the same call (``follow``) and every rank enters the same collectives in the same order. The
messages are tensors only: a fixed-size int64 header (the operation, each tensor's dtype and
shape), then one int64 and one float32 buffer holding them all (3 broadcasts per call, no
pickling between machines).

The groups are process groups of their own, not torch.distributed's default group, so nothing
process-global is set and a test can hold two groups. The calls and flags go over gloo on the
CPU. The model's all-reduces and gathers go over NCCL when every rank has a GPU of its own, else
over gloo (CUDA tensors through host memory: ranks sharing one GPU, which NCCL refuses). Every
collective has the group's timeout (a dead or hung rank raises :class:`ParallelError` on the
driver within it), except a worker's wait for the next call's header, on a group that never
times out.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from specserve.errors import ServiceUnavailable, SpecserveError

HEADER = 128  # int64 slots: [op, count, then (dtype, ndim, d0, d1, d2) per tensor]
MAX_TENSORS = (HEADER - 2) // 5
CONTROL_TIMEOUT = datetime.timedelta(days=365)  # a worker's wait for the next call
DTYPES = {1: torch.int32, 2: torch.int64, 3: torch.float32, 4: torch.bool, 5: torch.bfloat16, 6: torch.float16}
CODES = {v: k for k, v in DTYPES.items()}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # sent in the float32 buffer (exactly)


class ParallelError(ServiceUnavailable):
    """A rank died, a collective failed or timed out: the group is broken for good (the server
    answers 503, a stream ends with this error event, and the process exits)."""


class Op(enum.IntEnum):
    FORWARD = 1
    EMBED = 2
    LOGITS = 3
    INIT_KV = 4
    STOP = 5
    CUT_HEAD = 6  # a draft vocabulary's cut of the LM head (Transformer.cut_head)
    HINT = 7  # the weight and KV streams' prefetch hint (kernels/tune.py HintTrial): [1] t0, [0] the default


class TensorParallel:
    """rank / world of a group, its collectives and the driver-to-worker call protocol."""

    def __init__(self, rank: int, world: int, pg, timeout_s: float, control=None, data=None):
        self.rank, self.world, self.pg, self.timeout_s = rank, world, pg, timeout_s
        # the calls' headers go over a group of their own with no practical timeout: a worker waits
        # for the next call as long as the server idles (a driver that dies closes the connection)
        self.control = control if control is not None else pg
        self.data = data if data is not None else pg  # the model's collectives (NCCL, or gloo)
        self._depth = 0  # calls nested inside a mirrored one (forward -> embed) are not sent again
        self.busy_since: float | None = None  # driver: when the call in progress started (watchdog)
        self.failed: ParallelError | None = None
        self.closing = False  # the driver is stopping the workers: their exits are expected
        self.processes: dict = {}  # rank -> its local worker process (parallel/launch.py)

    @property
    def backend(self) -> str:  # of the model's collectives
        return "gloo" if self.data is self.pg else "nccl"

    @property
    def driver(self) -> bool:
        return self.rank == 0

    @classmethod
    def connect(cls, rank: int, world: int, host: str, port: int, timeout_s: float,
                connect_timeout_s: float = 600.0, device: torch.device | None = None) -> "TensorParallel":
        """Join the group at host:port (rank 0 serves the rendezvous store there). device: this
        rank's model device (CUDA: NCCL when no two ranks share a GPU)."""
        store = dist.TCPStore(host, port, world, rank == 0, timeout=datetime.timedelta(seconds=connect_timeout_s),
                              wait_for_workers=False)
        # every rank has loaded its shard before the groups connect (their set-up has the short timeout)
        store.set(f"ready/{rank}", device_key(device))
        store.wait([f"ready/{r}" for r in range(world)], datetime.timedelta(seconds=connect_timeout_s))
        keys = [store.get(f"ready/{r}").decode() for r in range(world)]  # the same list on every rank
        timeout = datetime.timedelta(seconds=timeout_s)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, world, timeout)
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world, CONTROL_TIMEOUT)
        data = None
        if choose_backend(keys) == "nccl":
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            data = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world, opts)
        group = cls(rank, world, pg, timeout_s, control, data)
        group._store = store  # the store serves the group's lifetime
        return group

    # ---- collectives -----------------------------------------------------------------------
    def _wait(self, work, what: str) -> None:
        if self.failed is not None:
            raise self.failed
        try:
            work.wait()
        except RuntimeError as exc:
            self._reap()
            self.failed = ParallelError(f"tensor-parallel {what} failed on rank {self.rank}: {_short(exc)}"
                                        f"{self._who()}")
            raise self.failed from exc

    def exchange(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's t, in rank order (this rank's own at its index). NCCL: its all-gather.
        Gloo: point-to-point sends and receives between every pair, for the small tensors of a
        decode step on one machine much quicker than gloo's ring all-reduce (timed by hand on 2
        ranks, 896 floats: ~0.2 ms against ~1.6 ms); a CUDA tensor goes through host memory."""
        t = t.contiguous()
        if self.backend == "nccl":
            parts = [torch.empty_like(t) for _ in range(self.world)]
            self._wait(self.data.allgather([parts], [t]), what)
            return parts
        if t.device.type != "cpu":
            return [p.to(t.device) for p in self.exchange(t.cpu(), what)]
        parts = [t if r == self.rank else torch.empty_like(t) for r in range(self.world)]
        works = []
        for r in range(self.world):
            if r != self.rank:
                works.append(self.pg.send([t], r, 0))
                works.append(self.pg.recv([parts[r]], r, 0))
        for work in works:
            self._wait(work, what)
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks, in place: added in rank order on every rank, so every rank
        holds the same bits and a step's sums do not depend on which rank finished first."""
        parts = self.exchange(t, "all-reduce")
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return t.copy_(total)

    def all_gather_cat(self, t: torch.Tensor) -> torch.Tensor:  # [.., n] each -> [.., world * n]
        return torch.cat(self.exchange(t, "all-gather"), dim=-1)

    def broadcast(self, t: torch.Tensor, control: bool = False) -> torch.Tensor:  # from rank 0, in place
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait((self.control if control else self.pg).broadcast([t], opts), "broadcast")
        return t

    def max_flag(self, flag: int) -> int:
        """The largest of every rank's flag (a rank that cannot go on says so with a non-zero one)."""
        t = torch.tensor([flag], dtype=torch.int64)
        self._wait(self.pg.allreduce([t], _max_opts()), "all-reduce")
        return int(t.item())

    # ---- the driver's calls, mirrored ------------------------------------------------------
    @contextlib.contextmanager
    def lead(self, op: int, tensors):
        """Around a driver call into the target: send it to the workers first (outermost only).
        tensors: a function giving the call's tensors (built only when sent)."""
        outer = self._depth == 0 and self.driver
        if outer:
            self.busy_since = time.monotonic()
        try:
            if outer:
                self.send(op, tensors())
            self._depth += 1
            try:
                yield
            except BaseException as exc:
                if outer and not isinstance(exc, ParallelError):  # the workers are inside the call still
                    self.fail(f"rank 0 failed in the middle of a tensor-parallel call ({type(exc).__name__}: "
                              f"{exc}); the ranks are out of step")
                raise
            finally:
                self._depth -= 1
        finally:
            if outer:
                self.busy_since = None

    def send(self, op: int, tensors: list[torch.Tensor | None]) -> None:
        if len(tensors) > MAX_TENSORS:
            raise ValueError(f"at most {MAX_TENSORS} tensors per call")
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0], header[1] = op, len(tensors)
        ints, floats = [], []
        for i, t in enumerate(tensors):
            if t is None:
                continue
            if t.dim() > 3 or t.dtype not in CODES:
                raise ValueError(f"cannot send a {t.dtype} tensor of {t.dim()} dims")
            header[2 + 5 * i:4 + 5 * i] = torch.tensor([CODES[t.dtype], t.dim()])
            header[4 + 5 * i:4 + 5 * i + t.dim()] = torch.tensor(t.shape)
            (floats if t.dtype in FLOATS else ints).append(t.reshape(-1))
        self.broadcast(header, control=True)
        if ints:
            self.broadcast(torch.cat([t.cpu().to(torch.int64) for t in ints]))
        if floats:
            self.broadcast(torch.cat([t.cpu().float() for t in floats]))

    def receive(self, device: torch.device | str = "cpu") -> tuple[int, list[torch.Tensor | None]]:
        """A worker's next call from the driver: (op, its tensors on ``device``)."""
        header = self.broadcast(torch.zeros(HEADER, dtype=torch.int64), control=True).tolist()
        op, count = header[0], header[1]
        specs = [(header[2 + 5 * i], header[4 + 5 * i:4 + 5 * i + header[3 + 5 * i]]) for i in range(count)]
        n_int = sum(_numel(s) for code, s in specs if code and DTYPES[code] not in FLOATS)
        n_float = sum(_numel(s) for code, s in specs if code and DTYPES[code] in FLOATS)
        ints = self.broadcast(torch.empty(n_int, dtype=torch.int64)) if n_int else None
        floats = self.broadcast(torch.empty(n_float, dtype=torch.float32)) if n_float else None
        out, oi, of = [], 0, 0
        for code, shape in specs:
            if not code:
                out.append(None)
            elif DTYPES[code] in FLOATS:
                out.append(floats[of:of + _numel(shape)].reshape(shape).to(device, DTYPES[code]))
                of += _numel(shape)
            else:
                out.append(ints[oi:oi + _numel(shape)].reshape(shape).to(device, DTYPES[code]))
                oi += _numel(shape)
        return op, out

    def stop(self) -> None:
        """Driver: tell the workers to exit (best effort: a broken group has nobody to tell)."""
        self.closing = True
        if self.driver and self.failed is None:
            with contextlib.suppress(ParallelError):
                self.send(Op.STOP, [])

    def fail(self, why: str) -> None:
        """Mark the group broken (a watchdog saw a rank die): every later collective raises."""
        if self.failed is None:
            self.failed = ParallelError(why)

    def _reap(self, wait_s: float = 2.0) -> None:
        """A collective failed: give a local worker that is exiting the moment to be seen doing so."""
        deadline = time.monotonic() + wait_s
        while self.processes and all(p.poll() is None for p in self.processes.values()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)

    def _who(self) -> str:
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
                for r, p in sorted(self.processes.items()) if p.poll() is not None]
        return f" ({'; '.join(dead)})" if dead else ""


def device_key(device: torch.device | None) -> str:
    """What a rank says of its device at the rendezvous: host and GPU, or "cpu"."""
    if device is None or device.type != "cuda":
        return "cpu"
    import socket

    props = torch.cuda.get_device_properties(device)
    return f"{socket.gethostname()}/cuda:{getattr(props, 'uuid', device.index)}"


def choose_backend(keys: list[str]) -> str:
    """The model collectives' backend from every rank's device_key (the same answer on every
    rank): NCCL when each rank has a GPU of its own, else gloo (NCCL refuses two ranks on one GPU)."""
    if all(k != "cpu" for k in keys) and len(set(keys)) == len(keys) and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _max_opts():
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    return opts


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split("] ", 1)[-1][:200]


def share_plan(tp: TensorParallel, plan) -> None:
    """Driver: send the memory plan's pool (blocks, block size, window blocks, KV dtype, a hybrid
    model's recurrent-state slots, planes and checkpoints) to the workers, which allocate their slice of it; refuse when any rank cannot hold its slice."""
    from specserve.models.kv_cache import KV_DTYPES

    numbers = [plan.num_blocks, plan.block_size, plan.window_blocks, KV_DTYPES.index(plan.kv_dtype),
               plan.state_slots, plan.state_planes, plan.state_checkpoints]
    with tp.lead(Op.INIT_KV, lambda: [torch.tensor(numbers, dtype=torch.int64)]):
        bad = tp.max_flag(0)
    if bad:
        raise SpecserveError(f"tensor-parallel rank {bad - 1}: its slice of the KV pool ({plan.num_blocks} blocks) "
                             "does not fit in its available memory: lower --kv-cache-memory")


def share_hint(tp: TensorParallel, set_local: Callable[[bool], object]) -> Callable[[bool], object]:
    """Driver: the prefetch hint's setter for an engine whose target runs tensor parallel. The hint is
    each process's own (its C library's), and the engine's trial times forwards every rank takes part
    in, so each setting reaches the workers too: sent when it changes (the engine sets it before every
    forward), between calls."""
    sent: list[bool] = []

    def set_t0(on: bool) -> object:
        if sent != [on]:
            tp.send(Op.HINT, [torch.tensor([int(on)], dtype=torch.int64)])
            sent[:] = [on]
        return set_local(on)

    return set_t0
