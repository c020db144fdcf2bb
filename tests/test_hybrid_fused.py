"""The fused CPU path of hybrid models (models/hybrid_fused.py: the layers of a forward in one C call)
against their per-op Python path, bit for bit: every forward's logits through an engine with
chunked prefill, a batch, speculation (verification widths and rollbacks to any snapshot plane,
a drafter reading hidden layers), every KV cache dtype, the prefix cache's state checkpoints,
quantized weights with the DeltaNet's input projections fused or apart, and every kernel build;
and what falls back to the Python path."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("transformers.models.qwen3_5")

from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.kernels import ops  # noqa: E402
from specserve.models.hybrid_fused import unsupported  # noqa: E402
from specserve.models.layers import linears  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from engine_utils import drafter_makers  # noqa: E402
from hybrid_utils import (DATA, OracleDrafter, assert_same_bits, greedy_outputs, make_engine,  # noqa: E402
                          random_prompt, repetitive, traced)

pytestmark = pytest.mark.skipif(not ops.kernels_available(), reason="no C compiler")


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_fused_layers_equal_the_python_path_chunked_batched_speculating(monkeypatch, hybrid, kv_dtype):
    ours, _ = hybrid
    prompts = [repetitive(s) if s % 2 else random_prompt(s, 40 + 9 * s) for s in range(4)]
    truth = dict(zip(map(tuple, prompts), greedy_outputs(make_engine(ours, max_num_seqs=4), prompts, 20)))

    def run():
        spec = SpeculativeConfig("ngram", num_speculative_tokens=5, adaptive=False)
        eng = make_engine(ours, spec, OracleDrafter(truth), max_num_seqs=4, kv_cache_dtype=kv_dtype,
                          max_num_batched_tokens=16, max_step_ms=0)
        out = greedy_outputs(eng, prompts, 20)
        assert eng.totals.accepted_tokens > 0 and eng.cache.idle()
        return out

    assert_same_bits(monkeypatch, ours, run)


@pytest.fixture(scope="module")
def moe_models(qwen3_5_moe, tmp_path_factory):
    """Qwen3.5-MoE three ways: llama-quantize's Q8_0 file (experts grouped in C, the shared expert,
    wider than the routed ones, apart); int8 weights with the shared expert as wide as the routed
    ones (folded into their grouped calls); float32 weights (experts that cannot be grouped: in
    Python between C calls)."""
    from tiny_models import make_tiny_qwen3_5_moe

    from specserve.models.loader import LoadOptions

    folded, _ = make_tiny_qwen3_5_moe(tmp_path_factory.mktemp("moe_folded"), seed=3, shared_intermediate=32,
                                      options=LoadOptions(quantization="int8"))
    return {"q8_0": load_model(str(DATA / "tiny-qwen35moe-q8_0.gguf")), "int8_folded": folded,
            "fp32": qwen3_5_moe[0]}


@pytest.mark.parametrize("kind", ["q8_0", "int8_folded", "fp32"])
def test_mixture_of_experts_fused(monkeypatch, moe_models, kind):
    """Each way the same bits as the Python path: chunked, batched, speculating with an oracle and with
    the checkpoint's MoE MTP head; one C call a forward where the experts are grouped, one a layer
    (ending at its mixer) where they run in Python."""
    from specserve.speculative.mtp import MTPDrafter

    ours = moe_models[kind]
    layers_call, n = ops.hybrid_layers, ours.config.num_layers
    prompts = [random_prompt(70 + s, 25 + 11 * s) for s in range(3)]
    truth = dict(zip(map(tuple, prompts), greedy_outputs(make_engine(ours, max_num_seqs=3), prompts, 16)))

    def run():
        spec = SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False)
        eng = make_engine(ours, spec, OracleDrafter(truth), max_num_seqs=3, max_num_batched_tokens=16, max_step_ms=0)
        mtp = make_engine(ours, SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False),
                          MTPDrafter.load(None, ours), max_num_seqs=3)
        return greedy_outputs(eng, prompts, 16), greedy_outputs(mtp, prompts, 16)

    oracle, mtp = assert_same_bits(monkeypatch, ours, run)
    assert oracle == mtp == list(truth.values())
    assert {layer.mlp._fold_shared for layer in ours.model.layers} == {kind == "int8_folded"}
    spans = []
    monkeypatch.setattr(ops, "hybrid_layers", lambda *a: spans.append(a[4:6]) or layers_call(*a))
    greedy_outputs(make_engine(ours), prompts[:1], 1)  # one forward
    assert spans == ([(i, i + 1) for i in range(n)] if kind == "fp32" else [(0, n)])


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_drafters_reading_hidden_states_see_the_same_bits(monkeypatch, hybrid, method):
    """dflash reads hidden layers (the stack runs in segments ending at them), MTP the final one."""
    ours, _ = hybrid
    prompts = [repetitive(3), random_prompt(7, 33)]

    def run():
        eng = make_engine(ours, *drafter_makers(DATA / "hf", ours, None, 256)[method](), max_num_seqs=2)
        return greedy_outputs(eng, prompts, 16)

    assert_same_bits(monkeypatch, ours, run)


def test_prefix_cache_state_checkpoints_fused(monkeypatch, hybrid):
    """A shared 600-token system prompt: the first request writes state checkpoints (one at 512),
    the second starts from one; the same bits as the Python path, which restores the same. Prefill
    in chunks of 16 ends a chunk where a checkpoint is written: a row whose state goes to a plane
    and to a checkpoint."""
    ours, _ = hybrid
    system = random_prompt(90, 600)

    def run():
        eng = make_engine(ours, max_model_len=1024, max_num_batched_tokens=16, max_step_ms=0)
        outs = []
        for i, p in enumerate((system + random_prompt(91, 40), system + random_prompt(92, 30))):
            res = list(eng.generate(p, SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"c{i}"))
            outs.append(([t for o in res for t in o.new_token_ids], res[-1].cached_tokens))
        return outs

    outs = assert_same_bits(monkeypatch, ours, run)
    assert [o[1] for o in outs] == [0, 512]


@pytest.mark.parametrize("apart", [9, 4, 3])
def test_quantized_weights_with_input_projections_fused_or_apart(monkeypatch, apart):
    """The Q8_0 file (the integer-dot path), its DeltaNet input projection as one call, as q|k|v and
    z|b|a, or as four (Linear.fused refusing `apart` weights at once, as for two formats)."""
    from specserve.models import layers as L

    fused = L.Linear.fused.__func__
    refuse = classmethod(lambda cls, raws, *a, **kw: None if len(raws) >= apart else fused(cls, raws, *a, **kw))
    monkeypatch.setattr(L.Linear, "fused", refuse)
    lm = load_model(str(DATA / "tiny-qwen35-q8_0.gguf"))
    monkeypatch.undo()
    prompts = [random_prompt(5, 24), repetitive(2)]
    run = lambda: greedy_outputs(make_engine(lm, max_num_seqs=2), prompts, 12)  # noqa: E731
    assert_same_bits(monkeypatch, lm, run)
    if apart == 9:  # weights switched to float32 activations mid-run: the C call's descriptors follow
        weights = [lin.weight for lin in linears(lm.model.layers)]

        def switching(at: int | None):
            eng, got = make_engine(lm, max_num_seqs=2), []
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
            try:
                for step in range(64):
                    if step == at:
                        for w in weights:
                            w.int_dot = False
                    got += [(o.request_id, o.new_token_ids) for o in eng.step()]
            finally:
                for w in weights:
                    w.int_dot = True
            return got

        assert_same_bits(monkeypatch, lm, lambda: switching(3))
        switched, _, _ = traced(monkeypatch, lm, True, lambda: switching(3))
        kept, _, _ = traced(monkeypatch, lm, True, lambda: switching(None))
        assert torch.equal(switched[2], kept[2]) and not torch.equal(switched[-1], kept[-1])


@pytest.mark.parametrize("variant", ["c-avx2", "c-scalar"])
def test_fused_layers_same_bits_in_every_build(monkeypatch, hybrid, variant):
    ours, _ = hybrid
    try:
        ops._select(variant)
    except ops.KernelError as e:
        pytest.skip(str(e))
    prompts = [random_prompt(11, 30), repetitive(5)]
    run = lambda: greedy_outputs(make_engine(ours, max_num_seqs=2), prompts, 12)  # noqa: E731
    native, _, _ = traced(monkeypatch, ours, True, run)
    ops.set_default_impl(variant)
    try:
        other = assert_same_bits(monkeypatch, ours, run)
        assert other == run()
        built, _, _ = traced(monkeypatch, ours, True, run)
    finally:
        ops.set_default_impl(None)
    assert all(torch.equal(a, b) for a, b in zip(native, built))


def test_what_falls_back_to_the_python_path(monkeypatch, hybrid):
    """A batch the C call cannot read (state indices of another dtype) and the torch kernels go the
    Python way."""
    from specserve.models.hybrid_fused import batch_supported

    ours, _ = hybrid
    assert unsupported(ours.model) is None
    eng = make_engine(ours)
    eng.add_request("a", repetitive(1), SamplingParams(max_tokens=1))
    eng.scheduler.admit()
    batch = eng.runner.batch(eng.scheduler.schedule(drafting=False))
    assert batch_supported(batch, eng.kv)
    batch.state_write = batch.state_write.int()
    assert not batch_supported(batch, eng.kv)
    ops.set_default_impl("torch")
    try:
        _, _, stacked = traced(monkeypatch, ours, True, lambda: greedy_outputs(make_engine(ours), [repetitive(1)], 4))
    finally:
        ops.set_default_impl(None)
    assert stacked == 0
