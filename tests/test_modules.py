"""The model as a stack of torch modules: every linear declares how tensor parallelism splits it,
the tensor-parallel hook gives the row-parallel ones (and a mixture of experts) the group that
sums their outputs, and the fused C path is built from the layers' declared parts."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.models.layers import Linear
from specserve.parallel.shard import Shard
from tiny_models import make_tiny_qwen3_next, make_tiny_target

from engine_utils import run_all


class IdentityGroup:
    """A one-rank process group that counts its all-reduces (the sum over one rank is the input)."""

    world, processes = 1, {}

    def __init__(self):
        self.reduces = 0

    def lead(self, op, tensors):
        return contextlib.nullcontext()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduces += 1
        return x

    def all_gather_cat(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _linears(model) -> dict[str, Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def test_a_dense_model_is_a_module_stack_declaring_its_parallel_splits(tmp_path):
    model = make_tiny_target(tmp_path).model
    assert isinstance(model, nn.Module) and isinstance(model.layers, nn.ModuleList)
    declared = {name: lin.parallel for name, lin in _linears(model).items()}
    assert declared["lm_head"] == "vocab"
    for i in range(len(model.layers)):
        assert declared[f"layers.{i}.qkv"] == declared[f"layers.{i}.mlp.gate_up"] == "column"
        assert declared[f"layers.{i}.o"] == declared[f"layers.{i}.mlp.down"] == "row"
    assert len(declared) == 1 + 4 * len(model.layers)


def test_the_tensor_parallel_hook_reduces_each_row_parallel_output_once(tmp_path):
    """With a one-rank group attached, the Python path all-reduces the embedding and each layer's
    o and down outputs (nothing else), the fused path sums inside its C call, and greedy tokens are
    those without a group; detaching restores the plain model."""
    target = make_tiny_target(tmp_path)
    model = target.model
    prompts = [[5, 9, 13, 77, 80], [40, 41, 42]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = [LLMEngine(target, EngineConfig(max_model_len=128)) for _ in range(3)]  # built without a group
    plain = run_all(engines[0], prompts, params)
    group = IdentityGroup()
    model.shard = Shard(0, 1)
    model.attach_tensor_parallel(group)
    try:
        assert {n for n, m in _linears(model).items() if m.reduce_group is group} == {
            f"layers.{i}.{p}" for i in range(len(model.layers)) for p in ("o", "mlp.down")}
        for fused, engine in ((False, engines[1]), (True, engines[2])):
            model.fused = fused
            group.reduces = 0
            assert run_all(engine, prompts, params) == plain
            assert group.reduces > 0
        model.fused = False
        group.reduces = 0
        model.forward(*_one_row_batch(model))
        assert group.reduces == 1 + 2 * len(model.layers)
    finally:
        model.fused, model.shard = True, None
        model.attach_tensor_parallel(None)
    assert model.tp is None and all(m.reduce_group is None for m in _linears(model).values())


def _one_row_batch(model):
    from specserve.engine.model_runner import BatchEntry, build_forward_batch
    from specserve.models.kv_cache import KVCache

    kv = KVCache.allocate(model.cfg, 4, 16, "fp32")
    return build_forward_batch([BatchEntry([7], 0, [[0]])], 16, 4, [0], model.device), kv


def test_a_mixture_of_experts_sums_its_experts_before_the_one_reduce(tmp_path):
    """Qwen3-Next: the experts' (and the shared expert's) down projections are partial sums that
    the MoE module adds up before its single all-reduce; the DeltaNet output is row-parallel."""
    model = make_tiny_qwen3_next(tmp_path)[0].model
    declared = {name: lin.parallel for name, lin in _linears(model).items()}
    experts = {n for n in declared if ".experts." in n and n.endswith(".down")}
    assert experts and all(declared[n] == "row_partial" for n in experts)
    outs = [n for n in declared if n.endswith(("mixer.out", "mixer.o"))]  # DeltaNet's and gated attention's
    assert len(outs) == len(model.layers) and all(declared[n] == "row" for n in outs)
    group = IdentityGroup()
    model.attach_tensor_parallel(group)
    try:
        moes = [m for m in model.modules() if type(m).__name__ == "SparseMoE"]
        assert moes and all(m.reduce_group is group for m in moes)
        assert all(_linears(model)[n].reduce_group is None for n in experts)
    finally:
        model.attach_tensor_parallel(None)


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_the_declared_splits_are_the_shard_plans(tmp_path, kind):
    """What each Linear declares is what parallel/shard.py does to its checkpoint tensors: rank 0
    of 2 keeps fewer output rows of a "column" or "vocab" linear, fewer input columns of a "row" or
    "row_partial" one, and all of a "replicated" one."""
    from dataclasses import replace

    from tiny_models import FP32
    from specserve.models.loader import load_model

    if kind == "llama":
        make_tiny_target(tmp_path)
    else:
        make_tiny_qwen3_next(tmp_path)
    whole = _linears(load_model(str(tmp_path), FP32).model)
    part = _linears(load_model(str(tmp_path), replace(FP32, shard=Shard(0, 2))).model)
    assert whole.keys() == part.keys()
    for name, lin in whole.items():
        got, cut = (part[name].out_features, part[name].in_features), (lin.out_features, lin.in_features)
        want = {"column": (got[0] < cut[0], got[1] == cut[1]), "vocab": (got[0] < cut[0], got[1] == cut[1]),
                "row": (got[0] == cut[0], got[1] < cut[1]), "row_partial": (got[0] == cut[0], got[1] < cut[1]),
                "replicated": (got == cut, True)}[lin.parallel]
        assert all(want), f"{name} declared {lin.parallel}: {cut} -> {got}"


def test_the_fused_stack_is_built_from_the_declared_parts(tmp_path):
    """A layer the C stack does not know (no fused_parts) sends the model to the Python path."""
    from specserve.models.fused import unsupported

    model = make_tiny_target(tmp_path).model
    assert unsupported(model) is None
    parts = model.layers[0].fused_parts()
    assert parts["linears"]["q"] is model.layers[0].qkv and parts["norms"]["attn_norm"] is model.layers[0].attn_norm

    class Opaque(nn.Module):
        def forward(self, x, batch, kv):
            return x

    model.layers[1] = Opaque()
    assert unsupported(model) == "layers the C stack does not know"


if __name__ == "__main__":
    pytest.main([__file__])
