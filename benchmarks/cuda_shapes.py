"""Real shapes on CUDA without the real weights: a catalog model's config and tokenizer with random
weights written on the GPU machine (its files do not reach it), and the checks that find where a
row's bits part between plain and speculative decoding. Used by benchmarks/cuda_check.py
(``--shape-dir``, ``--make-shape-dir``); every check here runs on the CPU too (``--device cpu``).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from cuda_check import DEVICE, decode_speed, greedy, tp_target
from specserve.engine.config import EngineConfig
from specserve.models.loader import LoadOptions, load_model
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.registry import build_drafter
from specserve.speculative.train import data as tdata


def make_shape_dir(name: str, out: Path) -> Path:
    """A catalog model's config.json and tokenizer, no weights (the device machine gets the
    weights at random from random_checkpoint): what --shape-dir reads. Dense Qwen2/Llama only."""
    target = load_model(name, LoadOptions(device="cpu"))
    c, tok = target.config, target.tokenizer
    out.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template, "bos_token": None,
                                                           "eos_token": tok.eos_token, "add_bos_token": False}))
    kind = "qwen2" if c.qkv_bias else "llama"
    cfg = {"architectures": ["Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM"], "model_type": kind,
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "max_position_embeddings": c.max_position,
           "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps, "tie_word_embeddings": c.tie_embeddings,
           "hidden_act": "silu", "torch_dtype": "bfloat16", "max_window_layers": c.num_layers}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def random_checkpoint(shape_dir: Path, out: Path, layers: int | None) -> Path:
    """shape_dir's config and tokenizer with random weights (bf16 safetensors) in out."""
    import shutil

    import transformers

    want = layers or json.loads((shape_dir / "config.json").read_text())["num_hidden_layers"]
    if (out / "model.safetensors").exists() and \
            json.loads((out / "config.json").read_text())["num_hidden_layers"] == want:
        return out  # written by an earlier check of this run
    out.mkdir(parents=True, exist_ok=True)
    for f in shape_dir.iterdir():
        shutil.copy(f, out / f.name)
    if layers:
        raw = json.loads((out / "config.json").read_text())
        raw["num_hidden_layers"] = raw["max_window_layers"] = layers
        raw.pop("layer_types", None)
        (out / "config.json").write_text(json.dumps(raw))
    cfg = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    with torch.device(DEVICE["name"]):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 1.5 / p.shape[-1] ** 0.5)
    hf.save_pretrained(out, safe_serialization=True)
    return out


def shape_speed(shape_dir: Path, work: Path, layers: int | None) -> dict:
    """Decode tok/s of random weights at real shapes on one rank and on two: plain and ngram."""
    from specserve.parallel.launch import stop_workers

    ckpt = random_checkpoint(shape_dir, work / "shape", layers)
    out = {"shape": shape_dir.name, "layers": layers}
    for label, make in (("tp1", lambda: load_model(str(ckpt), LoadOptions(device=DEVICE["name"]))),
                        ("tp2", lambda: tp_target(ckpt, "auto"))):
        target = make()
        try:
            ids = [tdata.chat_prompt_ids(target, SHAPE_PROMPT)]
            row = decode_speed(target, ids, 128, {"ngram": SpeculativeConfig("ngram", num_speculative_tokens=5)})
            if target.model.tp is not None:
                row["backend"] = target.model.tp.backend
            out[label] = row
        finally:
            if target.model.tp is not None:
                stop_workers(target.model.tp)
        del target
    out["ok"] = all(out[k]["ngram"]["identical_to_plain"] for k in ("tp1", "tp2"))
    return out


def first_differing(a: list[tuple], b: list[tuple]) -> int | None:
    """The first index where two lists of (label, tensor) hold tensors that differ in a bit."""
    return next((i for i in range(min(len(a), len(b))) if not torch.equal(a[i][1], b[i][1])), None)


class OpTrace:
    """One row of every op's output in a forward (linears, norms, rope, attention, act_mul), to
    find the first op whose row differs between two forwards."""

    def __init__(self, row: int = 0):
        from specserve.models import layers, transformer

        self.row = row  # the row recorded (row 0 of a call with fewer rows: the LM head's)
        self.rows: list[tuple[str, torch.Tensor]] = []
        self.saved = [(transformer, n, getattr(transformer, n)) for n in ("rms_norm", "paged_attention", "act_mul")]
        self.saved += [(cls, n, getattr(cls, n)) for cls in (layers.Linear, layers.Rope)
                       for n in ("forward", "__call__")]

    def __enter__(self):
        for owner, name, fn in self.saved:
            label = f"{getattr(owner, '__name__', '')}.{name}"
            setattr(owner, name, self._wrap(fn, label))
        return self

    def _wrap(self, fn, label):
        def run(*a, **kw):
            out = fn(*a, **kw)
            self.rows.append((label, out[self.row if out.shape[0] > self.row else 0].detach().clone()))
            return out
        return run

    def __exit__(self, *exc):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)


def sync() -> None:
    if DEVICE["name"] == "cuda":
        torch.cuda.synchronize()


def prefilled(target, seq: list[int], p: int, room: int):
    """A fresh cache holding seq[:p] (one prefill forward) with room for `room` more positions, and
    fwd(ids, start, rows, hidden=()) running a forward into it."""
    from specserve.engine.model_runner import BatchEntry, build_forward_batch
    from specserve.models.transformer import KVCache

    model, bs = target.model, 16
    nb = -(-(p + room + 1) // bs)
    kv = KVCache.allocate(target.config, nb, bs, model.dtype, model.device)

    def fwd(ids, start, rows, hidden=()):
        batch = build_forward_batch([BatchEntry(ids, start, [list(range(nb))])], bs, nb, rows, model.device,
                                    hidden_layers=hidden)
        return model.forward(batch, kv)

    fwd(seq[:p], 0, [p - 1])
    return fwd


def row_forwards(target, seq: list[int], p: int, k: int, trace: bool = False, timing: bool = False) -> dict:
    """Position p's row as a decode row (alone) and as the first of k + 1 verification rows, after
    the same prefill of seq[:p]: do its logits and each layer's output agree bit for bit?"""
    fwd, layers_all = prefilled(target, seq, p, k + 1), tuple(range(target.config.num_layers))
    if timing:  # ms per forward of 1 and of k + 1 rows at position p
        ms = {}
        for width in (1, k + 1):
            fwd(seq[p:p + width], p, list(range(width)))
            sync()
            t0 = time.perf_counter()
            for _ in range(10):
                fwd(seq[p:p + width], p, list(range(width)))
            sync()
            ms[width] = round((time.perf_counter() - t0) * 100, 2)
        return ms
    traces = [OpTrace(), OpTrace()]
    with traces[0] if trace else contextlib.nullcontext():
        one = fwd(seq[p:p + 1], p, [0], layers_all)
    with traces[1] if trace else contextlib.nullcontext():
        wide = fwd(seq[p:p + k + 1], p, list(range(k + 1)), layers_all)
    out = {"p": p, "logits_equal": torch.equal(one.logits[0], wide.logits[0]),
           "first_layer_differing": first_differing([(i, one.hidden[i][0]) for i in layers_all],
                                                    [(i, wide.hidden[i][0]) for i in layers_all])}
    if trace:
        a, b = traces[0].rows, traces[1].rows
        i = first_differing(a, b)
        out["first_op_differing"] = None if i is None else (i, a[i][0])
        out["ops_traced"] = len(a)
    return out


def wide_row(target, seq: list[int], q: int, width: int, row: int) -> tuple[torch.Tensor, list]:
    """Logits of row `row` of a forward of seq[q:q + width] after a prefill of seq[:q], and the op trace."""
    fwd = prefilled(target, seq, q, width)
    with OpTrace(row) as tr:
        lg = fwd(seq[q:q + width], q, [row]).logits[0]
    return lg, tr.rows


def first_token_difference(a: list[int], b: list[int]) -> int | None:
    return next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)


def check_shape_divergence(shape_dir: Path, work: Path, layers: int | None) -> dict:
    """Where ngram's greedy output leaves plain's at real shapes: the first differing token, plain
    run to run, and the decode row at that position against the same row inside wider forwards."""
    ckpt = random_checkpoint(shape_dir, work / "shape", layers)
    target = load_model(str(ckpt), LoadOptions(device=DEVICE["name"]))
    ids = [tdata.chat_prompt_ids(target, SHAPE_PROMPT)]
    plain = greedy(target, ids, 128)[0][0]
    again = greedy(target, ids, 128)[0][0]
    spec = SpeculativeConfig("ngram", num_speculative_tokens=5)
    got = greedy(target, ids, 128, spec, build_drafter(spec, target, None, EngineConfig(), 512))[0][0]
    i = first_token_difference(plain, got)
    out = {"plain_deterministic": plain == again, "lengths": [len(plain), len(got)], "first_difference": i}
    if i is None:
        return {"ok": len(plain) == len(got), **out}
    out["plain_around"], out["spec_around"] = plain[max(0, i - 3):i + 3], got[max(0, i - 3):i + 3]
    seq = ids[0] + plain
    p = len(ids[0]) + i - 1  # the row whose argmax is token i
    base, base_ops = wide_row(target, seq, p, 1, 0)
    lg = base.float()
    top2 = torch.topk(lg, 2)
    out["plain_top2"] = [[int(x) for x in top2.indices], [float(x) for x in top2.values]]
    out["logit_of_spec_token"] = float(lg[got[i]])
    rows = []
    for q in range(max(len(ids[0]), p - 5), p + 1):
        for width in range(p - q + 1, 7):
            other, ops = wide_row(target, seq, q, width, p - q)
            if not torch.equal(other, base):
                first = first_differing(ops, base_ops)
                rows.append({"start": q, "width": width, "argmax": int(other.float().argmax()),
                             "first_op": None if first is None else [first, base_ops[first][0]]})
    out["wide_rows_differing"] = rows[:10]
    out["ok"] = False
    return out


def logged_greedy(target, ids: list[int], max_tokens: int, spec=None) -> tuple[list[int], dict]:
    """One sequence's greedy output and everything to run its engine's forwards again: each
    forward batch (the drafter's calibration passes too), whose it was, and the KV pool's form."""
    from specserve.engine.model_runner import ModelRunner

    log, batch = {"batches": []}, ModelRunner.batch

    def logged(runner, rows):
        b = batch(runner, rows)
        log["batches"].append((rows[0].seq.request_id, b))
        log["pool"] = (runner.kv.k[0].shape[0], runner.block_size, runner.kv.kv_dtype)
        return b

    ModelRunner.batch = logged
    try:
        drafter = build_drafter(spec, target, None, EngineConfig(), 512) if spec else None
        return greedy(target, [ids], max_tokens, spec, drafter)[0][0], log
    finally:
        ModelRunner.batch = batch


def replay(target, log: dict, stop: int | None = None, trace_row: int | None = None) -> dict:
    """Run the logged batches[:stop] again in a fresh pool of the engine's form (each request row's
    layer outputs and logits kept by position, the last write winning); with trace_row,
    batches[stop] runs traced at that row."""
    from dataclasses import replace as copy

    from specserve.models.transformer import KVCache

    model, n_layers = target.model, target.config.num_layers
    blocks, bs, kv_dtype = log["pool"]
    kv = KVCache.allocate(target.config, blocks, bs, kv_dtype, model.device)
    hidden, writer = {}, {}
    batches = log["batches"] if stop is None else log["batches"][:stop]
    for f, (owner, b) in enumerate(batches):
        rows = b.input_ids.shape[0]
        res = model.forward(copy(b, hidden_layers=tuple(range(n_layers)),
                                 logits_indices=torch.arange(rows, device=model.device)), kv)
        if owner == "calibrate":
            continue
        for r, pos in enumerate(b.positions.tolist()):
            hidden[pos] = [res.hidden[i][r].clone() for i in range(n_layers)] + [res.logits[r].clone()]
            writer[pos] = (f, int(b.positions[0]), rows, r)
    out = {"hidden": hidden, "writer": writer}
    if trace_row is not None:
        b = log["batches"][stop][1]
        with OpTrace(trace_row) as tr:
            model.forward(copy(b, logits_indices=torch.tensor([trace_row], device=model.device)), kv)
        out["trace"] = tr.rows
    return out


def history_difference(target, plain_log: dict, spec_log: dict) -> dict | None:
    """Replay both runs' logged forwards: the first position whose layer outputs differ, the
    forward that wrote it in each run, and the first op that differs there (None: none differs)."""
    a, b = replay(target, plain_log), replay(target, spec_log)
    names = [f"layer {i}" for i in range(target.config.num_layers)] + ["logits"]
    for pos in sorted(set(a["hidden"]) & set(b["hidden"])):
        bad = [names[i] for i, (x, y) in enumerate(zip(a["hidden"][pos], b["hidden"][pos])) if not torch.equal(x, y)]
        if not bad:
            continue
        fa, fb = a["writer"][pos], b["writer"][pos]
        out = {"position": pos, "differs_in": bad[:3], "plain_writer": fa, "spec_writer": fb, "first_op": None}
        ta = replay(target, plain_log, fa[0], fa[3])["trace"]
        tb = replay(target, spec_log, fb[0], fb[3])["trace"]
        k = first_differing(ta, tb)
        if k is not None:
            diff = float((ta[k][1].float() - tb[k][1].float()).abs().max())
            out["first_op"] = {"index": k, "op": ta[k][0], "ops": len(ta), "max_abs_diff": diff}
        return out
    return None


def check_shape_history(shape_dir: Path, work: Path, layers: int | None) -> dict:
    """Replay the forwards plain and ngram decoding ran (real shapes, random weights) and find the
    first position whose layer outputs differ between the two histories, the forward that wrote
    it, and the first op that differs there (against the plain forward of that position)."""
    ckpt = random_checkpoint(shape_dir, work / "shape", layers)
    target = load_model(str(ckpt), LoadOptions(device=DEVICE["name"]))
    ids = tdata.chat_prompt_ids(target, SHAPE_PROMPT)
    plain, plain_log = logged_greedy(target, ids, 128)
    spec, spec_log = logged_greedy(target, ids, 128, SpeculativeConfig("ngram", num_speculative_tokens=5))
    first = history_difference(target, plain_log, spec_log)
    return {"ok": first is None and plain == spec, "identical": plain == spec, "prompt_len": len(ids),
            "first_difference": first_token_difference(plain, spec),
            "forwards": [len(plain_log["batches"]), len(spec_log["batches"])], "first_position": first}


SHAPE_PROMPT = ("Write a Python function that merges two sorted lists. Repeat: merge two sorted lists, "
                "merge two sorted lists, merge two sorted lists.")


def check_shape_rows(shape_dir: Path, work: Path, layers: int | None) -> dict:
    """Random weights at real shapes: a plain greedy continuation, then at positions along it
    the decode row against the same row verified among 5 others."""
    ckpt = random_checkpoint(shape_dir, work / "shape", layers)
    target = load_model(str(ckpt), LoadOptions(device=DEVICE["name"]))
    ids = tdata.chat_prompt_ids(target, "Write a Python function that merges two sorted lists.")
    plain, _, _ = greedy(target, [ids], 96)
    seq = ids + plain[0]
    rows = [row_forwards(target, seq, p, 5) for p in range(len(ids), len(seq) - 6, 6)]
    bad = [r for r in rows if not r["logits_equal"] or r["first_layer_differing"] is not None]
    out = {"positions": len(rows), "differing": bad[:8]}
    if bad:
        out["trace"] = row_forwards(target, seq, bad[0]["p"], 5, trace=True)
    from specserve.models import layers

    for label, tile in (("forward_ms_row_tiles", layers.CUDA_ROW_TILE), ("forward_ms_one_call", 0)):
        saved, layers.CUDA_ROW_TILE = layers.CUDA_ROW_TILE, tile
        try:
            out[label] = row_forwards(target, seq, len(ids) + 40, 5, timing=True)
        finally:
            layers.CUDA_ROW_TILE = saved
    out["ok"] = not bad
    return out
