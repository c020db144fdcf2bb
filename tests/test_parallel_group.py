"""The tensor-parallel group's wire format and backend choice (specserve/parallel/group.py):
two ranks as two threads of this process on a loopback store."""

from __future__ import annotations

import threading

import pytest
import torch

from specserve.bench.serverproc import free_port
from specserve.parallel.group import Op, TensorParallel, choose_backend, device_key


def two_ranks(body0, body1):
    """Run body0(group) as rank 0 and body1(group) as rank 1; their results."""
    port, out, errors = free_port(), {}, []

    def run(rank, body):
        try:
            tp = TensorParallel.connect(rank, 2, "127.0.0.1", port, 20.0, connect_timeout_s=20.0)
            out[rank] = body(tp)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r, b)) for r, b in ((0, body0), (1, body1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out[0], out[1]


def test_a_call_keeps_every_tensors_dtype_shape_and_bits():
    g = torch.Generator().manual_seed(0)
    sent = [torch.randn(3, 5, generator=g).to(torch.bfloat16), None, torch.randint(-9, 9, (4,), dtype=torch.int32),
            torch.randn(2, 2, 2, generator=g).to(torch.float16), torch.randn(6, generator=g),
            torch.tensor([True, False]), torch.arange(3)]
    _, (op, got) = two_ranks(lambda tp: tp.send(Op.LOGITS, sent), lambda tp: tp.receive())
    assert op == Op.LOGITS and len(got) == len(sent)
    for a, b in zip(sent, got):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_all_reduce_gives_every_rank_the_same_bits_in_rank_order():
    g = torch.Generator().manual_seed(1)
    x0, x1 = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g) * 1e4
    a, b = two_ranks(lambda tp: tp.all_reduce(x0.clone()), lambda tp: tp.all_reduce(x1.clone()))
    assert torch.equal(a, b) and torch.equal(a, x0 + x1)
    assert two_ranks(lambda tp: tp.backend, lambda tp: tp.backend) == ("gloo", "gloo")


@pytest.mark.parametrize("keys, backend", [
    (["cpu", "cpu"], "gloo"),
    (["a/cuda:GPU-1", "a/cuda:GPU-1"], "gloo"),  # two ranks on one GPU: NCCL refuses that
    (["a/cuda:GPU-1", "cpu"], "gloo"),
])
def test_ranks_without_a_gpu_each_use_gloo(keys, backend):
    assert choose_backend(keys) == backend


def test_ranks_with_a_gpu_each_use_nccl_where_torch_has_it():
    keys = ["a/cuda:GPU-1", "a/cuda:GPU-2", "b/cuda:GPU-1"]
    assert choose_backend(keys) == ("nccl" if torch.distributed.is_nccl_available() else "gloo")
    assert device_key(torch.device("cpu")) == device_key(None) == "cpu"


def test_ranks_take_gpus_in_turn_and_plan_from_the_gpu_they_share(monkeypatch):
    from specserve.models.loader import LoadOptions
    from specserve.parallel.launch import ranks_sharing_memory
    from specserve.parallel.shard import Shard

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    devices = [LoadOptions("cuda", shard=Shard(r, 4)).torch_device() for r in range(4)]
    assert devices == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    assert LoadOptions("cuda").torch_device() == torch.device("cuda")  # one rank: torch's current GPU
    assert ranks_sharing_memory(4, torch.device("cuda", 0)) == 2  # 4 ranks on 2 GPUs
    assert ranks_sharing_memory(2, torch.device("cuda", 0)) == 1
    assert ranks_sharing_memory(2, torch.device("cpu")) == 2  # the CPU's memory is one pool
