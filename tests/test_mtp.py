"""The MTP head drafter: checkpoint name mapping, its cache, and losslessness in the engine."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.types import SamplingParams
from specserve.models.layers import linears
from specserve.models.loader import load_model
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.drafter_files import save_drafter
from specserve.speculative.mtp import MTPConfig, MTPDrafter, MTPModel, read_checkpoint_mtp
from drafter_utils import check_prefix_hits_keep_context, seq_with_output
from tiny_models import FP32, TINY_VOCAB, make_tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny_mtp"), seed=5)


def random_head(target, seed: int = 0) -> MTPModel:
    m = MTPModel(MTPConfig.for_target(target))
    m.init_weights(target.model.final_norm, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return m


# HF names of a Qwen3-Next style MTP head (prefix "mtp." or "model.mtp.") and DeepSeek-V3 style
QWEN_NAMES = {"eh_proj.weight": "fc.weight", "enorm": "pre_fc_norm_embedding.weight",
              "hnorm": "pre_fc_norm_hidden.weight", "norm": "norm.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
               "q.weight": "self_attn.q_proj.weight", "k.weight": "self_attn.k_proj.weight",
               "v.weight": "self_attn.v_proj.weight", "o.weight": "self_attn.o_proj.weight",
               "gate.weight": "mlp.gate_proj.weight", "up.weight": "mlp.up_proj.weight",
               "down.weight": "mlp.down_proj.weight"}
DEEPSEEK_NAMES = {"eh_proj.weight": "eh_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight",
                  "norm": "shared_head.norm.weight"}


def _hf_names(style: str, n_layers: int) -> dict[str, str]:
    if style == "deepseek":
        pre = f"model.layers.{n_layers}."
        out = {k: pre + v for k, v in DEEPSEEK_NAMES.items()}
        out.update({f"layer.{k}": pre + v for k, v in LAYER_NAMES.items()})
        out["__extra__"] = pre + "embed_tokens.weight"  # DeepSeek repeats the embedding: ignored
        return out
    pre = "model.mtp." if style == "model.mtp" else "mtp."
    out = {k: pre + v for k, v in QWEN_NAMES.items()}
    out.update({f"layer.{k}": pre + "layers.0." + v for k, v in LAYER_NAMES.items()})
    return out


@pytest.mark.parametrize("style", ["mtp", "model.mtp", "deepseek"])
def test_loads_mtp_head_shipped_in_a_safetensors_checkpoint(tiny, tmp_path, style):
    from safetensors.torch import save_file

    src = tiny.resolved.path
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    head = random_head(tiny, seed=1)
    sd = head.state_dict()
    names = _hf_names(style, tiny.config.num_layers)
    tensors = {names[k]: v.clone() for k, v in sd.items()}
    if "__extra__" in names:
        tensors[names["__extra__"]] = torch.zeros(TINY_VOCAB, 64)
    save_file(tensors, str(d / "mtp.safetensors"))
    target = load_model(str(d), FP32)  # the target still loads (MTP tensors are not its layers)
    drafter = MTPDrafter.load(None, target)  # no "model": the head comes from the target's checkpoint
    state, _ = read_checkpoint_mtp(d)
    for k, v in sd.items():
        assert torch.equal(state[k], v), k
    _assert_net_holds(drafter, sd)
    assert drafter.hidden_layers == (tiny.config.num_layers - 1,)


def test_loads_gguf_nextn_tensors(tiny, tmp_path):
    import gguf

    head = random_head(tiny, seed=2)
    sd = head.state_dict()
    n = 3  # the MTP block follows the 3 ordinary blocks
    gg = {"eh_proj.weight": "nextn.eh_proj", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm",
          "norm": "nextn.shared_head_norm", "layer.attn_norm": "attn_norm", "layer.ffn_norm": "ffn_norm",
          "layer.q.weight": "attn_q", "layer.k.weight": "attn_k", "layer.v.weight": "attn_v",
          "layer.o.weight": "attn_output", "layer.gate.weight": "ffn_gate", "layer.up.weight": "ffn_up",
          "layer.down.weight": "ffn_down"}
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_uint32("qwen3.block_count", n + 1)
    w.add_uint32("qwen3.nextn_predict_layers", 1)
    w.add_uint32("qwen3.attention.head_count", 4)
    w.add_uint32("qwen3.attention.head_count_kv", 2)
    for k, name in gg.items():
        w.add_tensor(f"blk.{n}.{name}.weight", sd[k].numpy().astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float32))  # an ordinary block: ignored
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    state, source = read_checkpoint_mtp(path)
    assert set(state) == set(sd)
    for k, v in sd.items():
        assert torch.equal(state[k], v), k
    drafter = MTPDrafter.load(str(path), tiny)
    _assert_net_holds(drafter, sd)


def _assert_net_holds(drafter: MTPDrafter, sd: dict) -> None:
    """The drafter runs the head's weights (float32) in the family's layer module."""
    layer = drafter.net.stack.layers[0]
    assert torch.equal(drafter.net.eh_proj.float_weight(), sd["eh_proj.weight"])
    assert torch.equal(layer.o.float_weight(), sd["layer.o.weight"])
    assert torch.equal(layer.k.float_weight(), sd["layer.k.weight"])
    assert torch.equal(drafter.net.norm, sd["norm"]) and torch.equal(layer.attn_norm, sd["layer.attn_norm"])


def test_no_mtp_head_is_a_clear_error(tiny):
    with pytest.raises(Exception, match="ships no MTP head"):
        MTPDrafter.load(None, tiny)


def test_cached_rows_equal_a_full_forward_and_chain(tiny, tmp_path):
    head = random_head(tiny, seed=3)
    save_drafter(head, head.cfg.to_json(), tmp_path / "h")
    drafter = MTPDrafter.load(str(tmp_path / "h"), tiny)
    L = tiny.config.num_layers - 1
    T = 25
    hid = torch.randn(T, 64)
    ids = torch.randint(0, 256, (T + 1,)).tolist()
    seq = seq_with_output(ids, 12)
    drafter.observe(seq, {L: hid[:12]}, list(range(12)))
    drafter.observe(seq, {L: hid[12:]}, list(range(12, T)))
    g = drafter._catch_up(seq)  # rows 1..T (last token at position T)
    # the same rows in one teacher-forced pass
    from specserve.speculative.layers import rms

    hn = rms(hid, tiny.model.final_norm, tiny.config.rms_eps)
    emb = tiny.model.embed(torch.tensor(ids)).float()[None]
    full = head.train_forward(emb, hn[None], torch.ones(1, T + 1, dtype=torch.bool), 1)[0]
    torch.testing.assert_close(g, full[0, -1], rtol=1e-4, atol=1e-4)
    assert len(drafter._state(seq).kv) == T  # rows 1..T cached; chain rows are not
    prop = drafter.propose([seq], [4])[0]
    assert len(prop.token_ids) == 4 and prop.probs is None
    assert len(drafter._state(seq).kv) == T


def _engine(target, drafter=None, k: int = 3) -> LLMEngine:
    spec = SpeculativeConfig("mtp", num_speculative_tokens=k, adaptive=False) if drafter else None
    return LLMEngine(target, EngineConfig(max_num_seqs=4, max_model_len=256), spec, drafter)


def test_prefix_cache_hit_keeps_the_heads_context(tiny, tmp_path):
    head = random_head(tiny, seed=4)
    save_drafter(head, head.cfg.to_json(), tmp_path / "h")
    check_prefix_hits_keep_context(tiny, lambda store: MTPDrafter.load(str(tmp_path / "h"), tiny, store), "mtp")


def test_tiny_greedy_lossless_and_sampling_probs(tiny, tmp_path):
    from engine_utils import run_all

    head = random_head(tiny, seed=4)
    save_drafter(head, head.cfg.to_json(), tmp_path / "h")
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 21, 40)]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = run_all(_engine(tiny), prompts, greedy)
    eng = _engine(tiny, MTPDrafter.load(str(tmp_path / "h"), tiny))
    assert run_all(eng, prompts, greedy) == plain
    assert eng.totals.draft_tokens > 0 and eng.blocks.num_free == eng.blocks.num_blocks

    samp = SamplingParams(max_tokens=30, temperature=0.7, min_p=0.02, frequency_penalty=0.5, seed=5,
                          ignore_eos=True)
    a = run_all(_engine(tiny, MTPDrafter.load(str(tmp_path / "h"), tiny)), prompts, samp)
    b = run_all(_engine(tiny, MTPDrafter.load(str(tmp_path / "h"), tiny)), prompts, samp)
    assert a == b
    d = MTPDrafter.load(str(tmp_path / "h"), tiny)
    seq = seq_with_output(list(range(60, 75)), 10, samp)
    d.observe(seq, {tiny.config.num_layers - 1: torch.randn(14, 64)}, list(range(14)))
    prop = d.propose([seq], [3])[0]
    assert prop.probs.shape == (3, TINY_VOCAB)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(3))


def test_draft_vocabulary_and_int8_head(tiny, tmp_path):
    """draft_vocab_size cuts the LM head an MTP chain drafts from (ranked by the directory's token
    counts; the request's tokens join): every draft is in the set, greedy stays lossless, the
    head's linears run in int8 through the registry's default, and the size is checked."""
    from engine_utils import run_all
    from specserve.speculative.drafter_files import save_token_counts
    from specserve.speculative.registry import build_drafter

    head = random_head(tiny, seed=6)
    save_drafter(head, head.cfg.to_json(), tmp_path / "h")
    counts = torch.zeros(TINY_VOCAB, dtype=torch.int64)
    counts[64:] = torch.arange(TINY_VOCAB - 64, 0, -1)  # ids 0..63 never seen in "training"
    save_token_counts(counts, tmp_path / "h")
    spec = SpeculativeConfig("mtp", model=str(tmp_path / "h"), num_speculative_tokens=3, adaptive=False)
    assert {lin.format for lin in linears(build_drafter(spec, tiny, FP32, EngineConfig(), 256).net)} == {"int8"}

    def load():  # (the config's floor of 256 is over this vocabulary's 258: the drafter's own call)
        return MTPDrafter.load(str(tmp_path / "h"), tiny, weights="int8", draft_vocab_size=128)

    d = load()
    assert d.vocab.size == 128 and not d.vocab.member[:64].any()
    seq = seq_with_output(list(range(70, 90)) + [5, 6], 22)
    d.observe(seq, {tiny.config.num_layers - 1: torch.randn(22, 64)}, list(range(22)))
    drafts = d.propose([seq], [3])[0].token_ids
    assert d.vocab.member[[5, 6]].all() and drafts and all(d.vocab.member[t] for t in drafts)
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30)]
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    eng = _engine(tiny, load())
    assert run_all(eng, prompts, greedy) == run_all(_engine(tiny), prompts, greedy) and eng.totals.draft_tokens > 0
    with pytest.raises(Exception, match="draft_vocab_size 1000 is larger"):
        MTPDrafter.load(str(tmp_path / "h"), tiny, draft_vocab_size=1000)


def test_lossless_greedy_smollm2_mtp(tmp_path):
    import json

    from engine_utils import chat_ids, make_engine, run_all
    from specserve.speculative.train.trainer import make_model
    from drafter_utils import CHAT4

    target = load_model("smollm2-135m")
    m = make_model("mtp", target, seed=0)  # untrained (random-init) head
    save_drafter(m, m.cfg.to_json(), tmp_path / "h")
    params = SamplingParams(max_tokens=48)
    plain = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4")
    prompts = [chat_ids(plain, t) for t in CHAT4]
    want = run_all(plain, prompts, params)
    spec = json.dumps({"method": "mtp", "model": str(tmp_path / "h"), "num_speculative_tokens": 3, "adaptive": False})
    eng = make_engine("--model", "smollm2-135m", "--max-num-seqs", "4", "--speculative-config", spec)
    assert run_all(eng, prompts, params) == want
    assert eng.totals.draft_tokens > 0 and eng.blocks.num_free == eng.blocks.num_blocks


def test_draft_p_min_stops_the_chain(tiny, tmp_path):
    """draft_p_min: the chain stops at the first draft whose row's top probability is under it
    (no further chain steps); greedy output stays equal to plain greedy."""
    from engine_utils import run_all

    head = random_head(tiny, seed=4)
    save_drafter(head, head.cfg.to_json(), tmp_path / "h")
    samp = SamplingParams(max_tokens=30, temperature=0.7, seed=5, ignore_eos=True)

    def propose(p_min: float):
        d = MTPDrafter.load(str(tmp_path / "h"), tiny, p_min=p_min)
        seq = seq_with_output(list(range(60, 75)), 10, samp)
        d.observe(seq, {tiny.config.num_layers - 1: torch.randn(14, 64, generator=torch.Generator().manual_seed(1))},
                  list(range(14)))
        return d.propose([seq], [3])[0]

    full = propose(0.0)
    tops = full.probs.amax(-1)
    assert propose(float(tops.min()) * 0.999).token_ids == full.token_ids
    assert propose(float(tops[0]) * 1.001).token_ids == []

    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 21, 40)]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = run_all(_engine(tiny), prompts, greedy)
    counts = []
    for p_min in (0.0, 0.3):
        eng = _engine(tiny, MTPDrafter.load(str(tmp_path / "h"), tiny, p_min=p_min))
        assert run_all(eng, prompts, greedy) == plain
        counts.append(eng.totals.draft_tokens)
    assert counts[1] < counts[0]
