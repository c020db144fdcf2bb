"""Qwen3.5's own MTP head and Qwen3-Next (mixture-of-experts MLPs, interleaved DeltaNet
projections) against transformers' modules, and lossless with speculation.

* The checkpoint's MTP head (mtp.*) gives transformers' logits, for Qwen3.5 and Qwen3-Next; a
  trained head keeps the sampling distribution; a checkpoint without mtp.* fails at start-up.
* The tiny Qwen3-Next matches transformers, is lossless under speculation and chunking, and its
  GGUF (llama.cpp's converter) gives llama.cpp's greedy tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("transformers.models.qwen3_5")

from hybrid_utils import (DATA, LLAMA_CPP, RTOL, OracleDrafter, check_lossless_with_oracle_and_mtp,  # noqa: E402
                          check_matches_transformers, copy_checkpoint, greedy_outputs, make_engine, random_prompt,
                          repetitive)
from specserve.engine.types import SamplingParams  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.speculative.config import SpeculativeConfig  # noqa: E402
from specserve.speculative.mtp import MTPDrafter  # noqa: E402
from tiny_models import FP32, make_tiny_qwen3_next  # noqa: E402

# ---- the checkpoint's own MTP head -----------------------------------------------------------
def _reference_mtp_logits(hf, ids: list[int], ckpt: Path = DATA / "hf") -> torch.Tensor:
    """The MTP head (mtp.* of the checkpoint) in transformers' own modules (Qwen3.5's or
    Qwen3-Next's): row i reads token i's embedding and the target's final-normed hidden state at
    i - 1, through its norms, fc, one gated-attention decoder layer (causal over its rows; a MoE
    MLP for Qwen3-Next), its norm and the LM head."""
    from safetensors.torch import load_file
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    w = {k[4:]: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if k.startswith("mtp.")}
    cfg = hf.config
    layer_cls, norm_cls = {"qwen3_next": (Qwen3NextDecoderLayer, Qwen3NextRMSNorm),
                           "qwen3_5_moe_text": (Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm)}.get(
                               cfg.model_type, (Qwen3_5DecoderLayer, Qwen3_5RMSNorm))
    layer = layer_cls(cfg, cfg.layer_types.index("full_attention")).eval()
    sd = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}
    if "mlp.gate.weight" in sd:  # a MoE layer: transformers keeps its experts as 3-D tensors
        e = cfg.num_experts
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"mlp.experts.{j}.gate_proj.weight"),
                                                                 sd.pop(f"mlp.experts.{j}.up_proj.weight")])
                                                      for j in range(e)])
        sd["mlp.experts.down_proj"] = torch.stack([sd.pop(f"mlp.experts.{j}.down_proj.weight") for j in range(e)])
    layer.load_state_dict(sd)
    norms = {}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[n] = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        norms[n].load_state_dict({"weight": w[f"{n}.weight"]})
    x = torch.tensor([ids])
    with torch.no_grad():
        h = hf.model(x).last_hidden_state  # after the final norm
        e = hf.model.embed_tokens(x)
        z = torch.cat([norms["pre_fc_norm_embedding"](e[:, 1:]), norms["pre_fc_norm_hidden"](h[:, :-1])], -1)
        z = z @ w["fc.weight"].T
        pos = torch.arange(1, len(ids))[None]
        n = len(ids) - 1
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(z, hf.model.rotary_emb(z, pos), attention_mask=mask, position_ids=pos)
        return hf.lm_head(norms["norm"](out))[0]  # [n, V]: row j predicts token j + 2


@pytest.mark.parametrize("source", ["hf", "tiny-qwen35-f32.gguf", "qwen3_next", "tiny-qwen3next-f32.gguf",
                                    "qwen3_5_moe", "tiny-qwen35moe-f32.gguf"])
def test_checkpoint_mtp_head_matches_transformers_modules(hybrid, qwen3_next, qwen3_5_moe, source):
    """The head read from the safetensors (mtp.*, zero-centred norms), from llama.cpp's GGUF
    (blk.4.nextn.*, norms folded), or Qwen3-Next's and Qwen3.5-MoE's (a mixture-of-experts layer;
    from GGUF its experts merged into 3-D tensors) computes what transformers' modules compute."""
    if source in ("qwen3_next", "qwen3_5_moe"):
        ours, hf = qwen3_next if source == "qwen3_next" else qwen3_5_moe
        ckpt, target = ours.resolved.path, ours
    elif "qwen3next" in source or "qwen35moe" in source:
        ckpt = DATA / ("next_hf" if "qwen3next" in source else "moe_hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        target = load_model(str(DATA / source), FP32)
    else:
        hf, ckpt, target = hybrid[1], DATA / "hf", load_model(str(DATA / source), FP32)
    ids = random_prompt(7, 30)
    ref = _reference_mtp_logits(hf, ids, ckpt)
    head = MTPDrafter.load(None, target).net  # the family's gated-attention layer (and MoE) in float32
    assert head.cfg.output_gate and head.cfg.rotary_dim == 8
    eng = make_engine(target)
    eng.add_request("a", ids, SamplingParams(max_tokens=1))
    eng.scheduler.admit()
    rows = eng.scheduler.schedule(drafting=False)
    batch = eng.runner.batch(rows)
    hidden = target.model.forward(batch, eng.kv).final_hidden  # [T, H] after the final norm
    with torch.no_grad():
        emb = target.model.embed(torch.tensor(ids[1:]))
        g, _ = head(emb, hidden[:-1], torch.arange(1, len(ids)), None, None, causal=True)
        got = target.model.logits(head.out_norm(g))
    assert (got - ref).abs().max() <= RTOL * ref.abs().max()


def test_trained_mtp_head_keeps_the_sampling_distribution(hybrid, tmp_path):
    """train-drafter --method mtp on the hybrid target: greedy stays lossless, its mean acceptance
    length is what the training reports, and at temperature > 0 the joint distribution of the
    first three tokens is the target's exact one."""
    import subprocess
    import sys

    from test_suffix import sampled_joint_pvalue

    ours, _ = hybrid
    prompts = tmp_path / "p.json"
    rnd = random.Random(0)
    prompts.write_text(json.dumps([{"prompt": "".join(rnd.choice("abcdefgh ") for _ in range(rnd.randrange(20, 60)))}
                                   for _ in range(40)]))
    out = subprocess.run([sys.executable, "-m", "specserve", "train-drafter", "--model", str(DATA / "hf"), "--method",
                          "mtp", "--out", str(tmp_path / "mtp"), "--prompts", str(prompts), "--steps", "150",
                          "--max-new-tokens", "48", "--batch", "8", "--seq-len", "96", "--quantization", "none"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = (out.stderr + out.stdout).splitlines()
    report = next(ln for ln in lines if "final validation mean acceptance length" in ln)
    print(report)  # the trained head's mean acceptance length (pytest -s shows it)
    lines = (out.stderr + out.stdout).splitlines()
    untrained = next(ln for ln in lines if "step 0 validation mean acceptance length" in ln)
    length = lambda line: float(line.split("acceptance length")[1].split()[0])  # noqa: E731
    assert length(report) > length(untrained)  # training taught the head something (1.0 is the floor)
    assert (tmp_path / "mtp" / "token_counts.safetensors").is_file()  # what ranks its draft_vocab_size
    spec = SpeculativeConfig("mtp", num_speculative_tokens=3, adaptive=False, model=str(tmp_path / "mtp"))
    eng = make_engine(ours, spec, MTPDrafter.load(str(tmp_path / "mtp"), ours), max_num_seqs=32)
    prompts = [repetitive(s) for s in range(8)]
    assert greedy_outputs(eng, prompts, 24) == greedy_outputs(make_engine(ours, max_num_seqs=8), prompts, 24)
    assert eng.totals.accepted_tokens > 0
    assert sampled_joint_pvalue(eng, ours, [11, 12, 13, 14] * 5, 1000) > 0.001


def test_mtp_without_mtp_tensors_fails_at_start_up(hybrid, tmp_path):
    from safetensors.torch import load_file, save_file

    from specserve.errors import SpecserveError

    dst, _ = copy_checkpoint(hybrid, tmp_path)
    f = dst / "model.safetensors"
    save_file({k: v for k, v in load_file(str(f)).items() if not k.startswith("mtp.")}, str(f),
              metadata={"format": "pt"})
    with pytest.raises(SpecserveError, match="ships no MTP head"):
        MTPDrafter.load(None, load_model(str(dst), FP32))


# ---- Qwen3-Next: mixture-of-experts MLPs, interleaved DeltaNet projections ---------------------
@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"), mtp=True)


def test_qwen3_next_matches_transformers(qwen3_next):
    ours, hf = qwen3_next
    cfg = ours.config
    assert cfg.arch == "qwen3next" and cfg.moe.num_experts == 4 and cfg.moe.sparse(2) and not cfg.moe.sparse(3)
    check_matches_transformers(ours, hf, seed=3)


def test_qwen3_next_speculation_and_chunking_are_lossless(qwen3_next):
    check_lossless_with_oracle_and_mtp(qwen3_next[0], seed=60)  # its MTP head: a MoE layer


def test_qwen3_next_gguf_greedy_equals_llama_cpp():
    """llama.cpp's GGUF of a Qwen3-Next (experts merged into 3-D tensors, ssm_ba interleaved per
    key head, value heads in the grouped order): native llama-server's greedy tokens, all of them
    (32 per prompt, or up to its end-of-text token); and lossless under speculation."""
    ours = load_model(str(DATA / "tiny-qwen3next-f32.gguf"), FP32)
    assert ours.config.arch == "qwen3next" and ours.config.moe.num_experts == 4 and not ours.config.deltanet.v_tiled
    prompts, n = LLAMA_CPP["prompts"], LLAMA_CPP["tokens"]
    plain = [greedy_outputs(make_engine(ours), [p], n)[0] for p in prompts]
    ref = LLAMA_CPP["files"]["tiny-qwen3next-f32.gguf"]  # llama.cpp stops at the end-of-text token
    assert [g[:len(r)] for g, r in zip(plain, ref)] == ref and sum(map(len, ref)) >= 3 * n
    truth = {tuple(p): out for p, out in zip(prompts, plain)}
    eng = make_engine(ours, SpeculativeConfig("ngram", num_speculative_tokens=4), OracleDrafter(truth), max_num_seqs=4)
    assert greedy_outputs(eng, prompts, n) == plain
