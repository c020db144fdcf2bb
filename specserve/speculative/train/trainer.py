"""Train a dflash or mtp drafter on a frozen target's self-distilled data.

* **dflash**: per sequence, random anchor positions in the answer; each anchor's block
  ``[x_a, mask * (B-1)]`` attends to the injected context of positions before the anchor
  (within ``context_window``) and to its whole block, never to another block
  (``DFlashModel.block_mask``). Block row ``r`` learns ``x_{a+r}``.
* **mtp**: the chain is teacher-forced over whole sequences for ``depth`` steps
  (``MTPModel.train_forward``); depth ``d`` row ``i`` learns ``x_{i+1}``.
* Loss: cross-entropy through the target's frozen LM head, on answer tokens only, weighted
  ``decay ** (r - 1)`` by block row (dflash) or depth (mtp), so earlier drafts count more.
* AdamW, linear warmup then cosine decay to 10% of ``lr``; gradient clipping at 1.0.
* Validation: mean acceptance length, simulated greedily on held-out sequences: at fixed
  anchors, how many leading drafts equal the target's own tokens (greedy data: its greedy
  tokens), + 1 (llama.cpp's convention). For mtp the chain's later steps are the
  teacher-forced ones (exact whenever the earlier drafts were accepted, which is all that is
  counted), but each step attends to rows of its own depth, an approximation of inference.
* Checkpoints (``OUT/checkpoint``): float32 weights (safetensors), optimizer state, step,
  RNG states (the trainer's generator, torch's, python's) and the log; ``resume`` continues
  bit-identically on the same machine.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.errors import SpecserveError
from specserve.speculative.dflash import DFlashConfig, DFlashModel
from specserve.speculative.drafter_files import save_drafter
from specserve.speculative.layers import head_logits
from specserve.speculative.mtp import MTPConfig, MTPModel
from specserve.speculative.train.data import Example

log = logging.getLogger("specserve.train")


@dataclass
class HParams:
    steps: int = 1000
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.01
    batch: int = 8
    seq_len: int = 512
    anchors: int = 8  # dflash: blocks per sequence; mtp: loss rows per sequence and depth
    decay: float = 0.8
    seed: int = 0
    eval_every: int = 100
    save_every: int = 100
    val_anchors: int = 16

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class FrozenTarget:
    """What training needs of the target, as plain float tensors (differentiable head)."""

    embed_table: torch.Tensor  # [V, H] (embed_scale already applied)
    head: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    softcap: float = 0.0

    @classmethod
    def from_target(cls, target, device: torch.device) -> "FrozenTarget":
        from specserve.speculative.layers import TargetHead

        m = target.model
        table = m.embed_table.float() * (m.cfg.embed_scale if m.cfg.embed_scale != 1.0 else 1.0)
        return cls(table.to(device), TargetHead(target).float_head().to(device), m.final_norm.float().to(device),
                   m.cfg.final_softcap)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_table[ids]


@dataclass
class TrainState:
    step: int = 0
    log: list[dict] = field(default_factory=list)


class Trainer:
    def __init__(self, method: str, model: torch.nn.Module, frozen: FrozenTarget, train: list[Example],
                 val: list[Example], hp: HParams, out: Path, device: torch.device):
        if method not in ("dflash", "mtp"):
            raise SpecserveError(f"unknown drafter method {method!r}")
        if not train:
            raise SpecserveError("no training sequences")
        self.method, self.model, self.frozen, self.hp, self.out = method, model.to(device), frozen, hp, out
        self.train_set, self.val_set, self.device = train, val, device
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr, betas=(0.9, 0.95))
        self.gen = torch.Generator().manual_seed(hp.seed)
        self.state = TrainState()

    # ---- schedule ---------------------------------------------------------------------------
    def lr_at(self, step: int, time_fraction: float = 0.0) -> float:
        """Linear warmup, then cosine decay to 10% over the steps (or over a time budget:
        ``time_fraction`` of it spent, whichever is further)."""
        hp = self.hp
        if step < hp.warmup:
            return hp.lr * (step + 1) / hp.warmup
        t = max((step - hp.warmup) / max(1, hp.steps - hp.warmup), time_fraction)
        return hp.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    # ---- batches ----------------------------------------------------------------------------
    def _crop(self, ex: Example, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A window of at most seq_len tokens that contains answer tokens; (ids, hidden, prompt_len)."""
        T, L = len(ex.ids), self.hp.seq_len
        if T <= L:
            return ex.ids, ex.hidden, ex.prompt_len
        lo = max(0, min(ex.prompt_len - L // 2, T - L))
        s = lo if gen is None else int(torch.randint(lo, T - L + 1, (1,), generator=gen))
        return ex.ids[s:s + L], ex.hidden[s:s + L], max(ex.prompt_len - s, 0)

    def _pad(self, items: list[tuple[torch.Tensor, torch.Tensor, int]]):
        """Right-padded batch on the trainer's device: ids [b, T], hidden [b, T, F] float32,
        valid [b, T], prompt lengths, lengths."""
        T = max(len(i) for i, _, _ in items)
        b, d = len(items), self.device
        F_ = items[0][1].shape[-1]
        ids = torch.zeros(b, T, dtype=torch.int64, device=d)
        hid = torch.zeros(b, T, F_, device=d)
        valid = torch.zeros(b, T, dtype=torch.bool, device=d)
        for r, (i, h, _) in enumerate(items):
            ids[r, :len(i)] = i.to(d)
            hid[r, :len(i)] = h.to(d).float()
            valid[r, :len(i)] = True
        return ids, hid, valid, [pl for _, _, pl in items], [len(i) for i, _, _ in items]

    def _anchors(self, prompt_lens: list[int], lens: list[int], m: int, gen: torch.Generator | None,
                 stride: bool = False) -> torch.Tensor:
        """[b, m] anchor positions in the answer (a >= prompt_len - 1, a <= len - 2)."""
        rows = []
        for pl, n in zip(prompt_lens, lens):
            lo, hi = max(pl - 1, 0), n - 2
            hi = max(hi, lo)
            span = hi - lo + 1
            if stride or gen is None:
                a = [lo + (i * span) // m for i in range(m)]
            elif span >= m:
                a = (torch.randperm(span, generator=gen)[:m] + lo).tolist()
            else:
                a = (torch.randint(0, span, (m,), generator=gen) + lo).tolist()
            rows.append(sorted(a))
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    # ---- losses -----------------------------------------------------------------------------
    def _dflash_outputs(self, ids, hid, anchors):
        emb = self.frozen.embed(torch.gather(ids, 1, anchors))
        return self.model.train_forward(hid, emb, anchors)  # [b, m, B, H]

    def _dflash_labels(self, ids, anchors, lens):
        B = self.model.cfg.block_size
        r = torch.arange(1, B, device=self.device)
        pos = anchors[:, :, None] + r  # [b, m, B-1]
        lens_t = torch.tensor(lens, device=self.device)[:, None, None]
        ok = pos < lens_t
        labels = torch.gather(ids, 1, pos.clamp(max=ids.shape[1] - 1).flatten(1)).view_as(pos)
        return labels, ok

    def loss_dflash(self, batch) -> torch.Tensor:
        ids, hid, valid, pls, lens = batch
        anchors = self._anchors(pls, lens, self.hp.anchors, self.gen)
        out = self._dflash_outputs(ids, hid, anchors)[:, :, 1:]  # [b, m, B-1, H]
        labels, ok = self._dflash_labels(ids, anchors, lens)
        B = self.model.cfg.block_size
        w = (self.hp.decay ** torch.arange(B - 1, device=self.device, dtype=torch.float32)).expand_as(labels) * ok
        logits = head_logits(out[ok], self.frozen.head, self.frozen.softcap)
        ce = F.cross_entropy(logits, labels[ok], reduction="none")
        return (ce * w[ok]).sum() / w[ok].sum()

    def _mtp_inputs(self, ids, hid):
        return self.frozen.embed(ids), hid

    def loss_mtp(self, batch) -> torch.Tensor:
        ids, hid, valid, pls, lens = batch
        emb, hidden = self._mtp_inputs(ids, hid)
        depth = self.model.cfg.depth
        outs = self.model.train_forward(emb, hidden, valid, depth)
        total, wsum = 0.0, 0.0
        b, T = ids.shape
        for d, g in enumerate(outs, start=1):
            pos = torch.arange(d, T, device=self.device)  # row positions
            tgt = pos + 1
            rows_g, rows_lbl = [], []
            for r in range(b):
                ok = ((tgt < lens[r]) & (tgt >= pls[r])).nonzero().flatten()
                if ok.numel() == 0:
                    continue
                pick = ok[torch.randperm(ok.numel(), generator=self.gen)[:self.hp.anchors * 4].to(self.device)]
                rows_g.append(g[r, pick])
                rows_lbl.append(ids[r, tgt[pick]])
            if not rows_g:
                continue
            gg, lbl = torch.cat(rows_g), torch.cat(rows_lbl)
            logits = head_logits(self.model.out_norm(gg), self.frozen.head, self.frozen.softcap)
            wd = self.hp.decay ** (d - 1)
            total = total + wd * F.cross_entropy(logits, lbl, reduction="sum")
            wsum += wd * lbl.numel()
        if wsum == 0:
            return torch.zeros((), requires_grad=True)
        return total / wsum

    def sample_batch(self):
        idx = torch.randint(0, len(self.train_set), (self.hp.batch,), generator=self.gen).tolist()
        return self._pad([self._crop(self.train_set[i], self.gen) for i in idx])

    # ---- the loop ---------------------------------------------------------------------------
    def train_step(self, time_fraction: float = 0.0) -> float:
        self.model.train()
        lr = self.lr_at(self.state.step, time_fraction)
        for g in self.opt.param_groups:
            g["lr"] = lr
        batch = self.sample_batch()
        with self._autocast():
            loss = self.loss_dflash(batch) if self.method == "dflash" else self.loss_mtp(batch)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.state.step += 1
        return float(loss.detach())

    def _autocast(self):
        """bfloat16 matmuls on CUDA (weights, optimizer and loss reduction stay float32)."""
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    @torch.no_grad()
    def evaluate(self, examples: list[Example] | None = None) -> dict:
        """Validation loss-free metric: simulated greedy mean acceptance length (+ per-position)."""
        self.model.eval()
        examples = self.val_set if examples is None else examples
        if not examples:
            return {}
        accepted, n_anchors = 0, 0
        k_max = self.model.cfg.block_size - 1 if self.method == "dflash" else self.model.cfg.depth
        per_pos = [0] * k_max
        for i in range(0, len(examples), self.hp.batch):
            items = [self._crop(e, None) for e in examples[i:i + self.hp.batch]]
            ids, hid, valid, pls, lens = self._pad(items)
            if self.method == "dflash":
                anchors = self._anchors(pls, lens, self.hp.val_anchors, None, stride=True)
                out = self._dflash_outputs(ids, hid, anchors)[:, :, 1:]
                drafts = head_logits(out, self.frozen.head, self.frozen.softcap).argmax(-1)  # [b, m, B-1]
                labels, ok = self._dflash_labels(ids, anchors, lens)
                match = (drafts == labels) & ok
            else:
                emb, hidden = self._mtp_inputs(ids, hid)
                outs = self.model.train_forward(emb, hidden, valid, k_max)
                anchors = self._anchors([max(p, 2) for p in pls], lens, self.hp.val_anchors, None, stride=True)
                cols = []
                for d, g in enumerate(outs, start=1):
                    row = (anchors + d - 1 - d).clamp(min=0)  # row index of position a + d - 1 in G_d
                    gp = torch.gather(g, 1, row[..., None].expand(-1, -1, g.shape[-1]).clamp(max=g.shape[1] - 1))
                    tok = head_logits(self.model.out_norm(gp), self.frozen.head, self.frozen.softcap).argmax(-1)
                    lp = anchors + d
                    lbl = torch.gather(ids, 1, lp.clamp(max=ids.shape[1] - 1))
                    ok = lp < torch.tensor(lens, device=self.device)[:, None]
                    cols.append((tok == lbl) & ok)
                match = torch.stack(cols, dim=-1)
            lead = match.long().cumprod(-1)  # [b, m, k]
            accepted += int(lead.sum())
            n_anchors += lead.shape[0] * lead.shape[1]
            for j in range(lead.shape[-1]):
                per_pos[j] += int(lead[..., j].sum())
        mal = 1 + accepted / max(n_anchors, 1)
        return {"mean_acceptance_length": mal, "anchors": n_anchors,
                "accept_rate_per_pos": [p / max(n_anchors, 1) for p in per_pos]}

    def run(self, stop_at: int | None = None, time_limit: float | None = None, progress=print,
            time_budget: float | None = None) -> dict:
        """Train until hp.steps (or stop_at / time_limit seconds); checkpoints as it goes.

        time_budget (seconds): also stop when it is spent, and let the cosine schedule follow
        the elapsed time, so that it ends on time whatever the device's speed (such a run is
        not bit-reproducible on resume)."""
        t0 = time.perf_counter()
        last = stop_at if stop_at is not None else self.hp.steps
        last = min(last, self.hp.steps)
        limit = min(x for x in (time_limit, time_budget, math.inf) if x is not None)
        losses = []
        frac = 0.0
        while self.state.step < last:
            loss = self.train_step(frac)
            losses.append(loss)
            step = self.state.step
            elapsed = time.perf_counter() - t0
            frac = elapsed / time_budget if time_budget else 0.0
            if step % 10 == 0 or step == last:
                avg = sum(losses) / len(losses)
                lr = self.lr_at(step - 1, frac)
                self.state.log.append({"step": step, "loss": avg, "lr": lr, "elapsed_s": round(elapsed, 1)})
                progress(f"step {step}/{self.hp.steps} loss {avg:.4f} lr {lr:.2e}")
                losses = []
            if self.hp.eval_every and step % self.hp.eval_every == 0 and self.val_set:
                ev = self.evaluate()
                self.state.log.append({"step": step, **ev})
                progress(f"step {step} validation mean acceptance length {ev['mean_acceptance_length']:.3f}")
            if self.hp.save_every and step % self.hp.save_every == 0:
                self.save_checkpoint()
            if time.perf_counter() - t0 > limit:
                progress(f"time limit reached at step {step}")
                break
        self.save_checkpoint()
        return {"step": self.state.step}

    # ---- checkpoints ------------------------------------------------------------------------
    def cfg_json(self) -> dict:
        cfg = self.model.cfg.to_json()
        start = {k: v for k, v in (cfg.get("training") or {}).items() if k == "init_from"}
        cfg["training"] = {"hparams": self.hp.to_json(), "step": self.state.step, **start}
        return cfg

    def save_checkpoint(self) -> None:
        ck = self.out / "checkpoint"
        save_drafter(self.model, self.cfg_json(), ck)
        torch.save({"step": self.state.step, "optimizer": self.opt.state_dict(), "gen": self.gen.get_state(),
                    "torch_rng": torch.get_rng_state(), "py_random": random.getstate(),
                    "hparams": self.hp.to_json(), "log": self.state.log}, str(ck / "trainer.pt.tmp"))
        (ck / "trainer.pt.tmp").replace(ck / "trainer.pt")

    def load_checkpoint(self) -> None:
        from safetensors.torch import load_file

        ck = self.out / "checkpoint"
        if not (ck / "trainer.pt").is_file():
            raise SpecserveError(f"--resume: no checkpoint in {ck}")
        obj = torch.load(str(ck / "trainer.pt"), weights_only=True)  # tensors and plain containers only
        self.model.load_state_dict(load_file(str(ck / "model.safetensors")))
        self.opt.load_state_dict(obj["optimizer"])
        self.gen.set_state(obj["gen"])
        torch.set_rng_state(obj["torch_rng"])
        random.setstate(obj["py_random"])
        self.state = TrainState(obj["step"], obj["log"])

    def export(self, dtype: torch.dtype = torch.float32) -> None:
        save_drafter(self.model, self.cfg_json(), self.out, dtype)
        (self.out / "train_log.json").write_text(json.dumps(self.state.log, indent=1) + "\n")


def make_model(method: str, target, *, layers: int = 1, block_size: int = 8, num_target_layers: int = 3,
               intermediate_size: int | None = None, depth: int = 3, seed: int = 0,
               init_from_target: bool = False) -> torch.nn.Module:
    """A fresh drafter. With init_from_target (dflash), drafter layer i starts as a copy of the
    target's layer ``num_layers - layers + i`` (same shapes needed: the target's MLP width)."""
    std = float(target.model.embed_table.float().std())
    if method == "dflash":
        cfg = DFlashConfig.for_target(target, num_layers=layers, block_size=block_size,
                                      num_target_layers=num_target_layers, intermediate_size=intermediate_size)
        model = DFlashModel(cfg)
        model.init_weights(std, target.model.final_norm.cpu(), seed)
        if init_from_target:
            copy_target_layers(model, target)
        return model
    if method == "mtp":
        cfg = MTPConfig.for_target(target, intermediate_size=intermediate_size, depth=depth)
        model = MTPModel(cfg)
        model.init_weights(target.model.final_norm.cpu(), seed)
        return model
    raise SpecserveError(f"unknown drafter method {method!r}")


def copy_target_layers(model: DFlashModel, target) -> None:
    """Start the drafter's layers as copies of the target's last layers (a warm start)."""
    tcfg, layers = target.config, target.model.layers
    if model.cfg.intermediate_size != tcfg.intermediate_size or model.cfg.qk_norm or tcfg.qkv_bias:
        raise SpecserveError("--init-from-target needs the target's MLP width and a Llama-style layer "
                             f"(drafter width {model.cfg.intermediate_size}, target {tcfg.intermediate_size})")
    first = len(layers) - len(model.layers)
    for mine, src in zip(model.layers, layers[first:]):
        if src.qkv is not None:
            q, k, v = src.qkv.float_weight().cpu().split(src.split_qkv)
        else:
            q, k, v = (x.float_weight().cpu() for x in (src.q, src.k, src.v))
        mlp = src.mlp
        if mlp.gate_up is not None:
            gate, up = mlp.gate_up.float_weight().cpu().chunk(2)
        else:
            gate, up = mlp.gate.float_weight().cpu(), mlp.up.float_weight().cpu()
        with torch.no_grad():
            for lin, w in ((mine.q, q), (mine.k, k), (mine.v, v), (mine.o, src.o.float_weight().cpu()),
                           (mine.gate, gate), (mine.up, up), (mine.down, mlp.down.float_weight().cpu())):
                lin.weight.copy_(w)
            mine.attn_norm.copy_(src.attn_norm.float().cpu())
            mine.ffn_norm.copy_(src.ffn_norm.float().cpu())


def model_from_checkpoint(method: str, out: Path) -> torch.nn.Module:
    cfg = json.loads((out / "checkpoint" / "config.json").read_text())
    if cfg.get("drafter") != method:
        raise SpecserveError(f"--resume: {out} holds a {cfg.get('drafter')!r} drafter, not {method!r}")
    return DFlashModel(DFlashConfig.from_json(cfg)) if method == "dflash" else MTPModel(MTPConfig.from_json(cfg))


def model_from_drafter(method: str, where: str, target) -> torch.nn.Module:
    """A drafter to fine-tune: a trained one (a directory written by train-drafter, or a catalog
    drafter's name) in float32 (int8 exports are dequantized), checked against ``target``. Its
    config records where it started (``training.init_from``)."""
    from specserve.models.catalog import drafter_location
    from specserve.speculative.dflash import load_dflash_model
    from specserve.speculative.mtp import load_mtp_model

    directory = Path(drafter_location(where)).expanduser()
    model = load_dflash_model(directory, target) if method == "dflash" else load_mtp_model(directory, target)
    name = where if drafter_location(where) != where else str(directory.resolve())  # a path: absolute
    model.cfg.training = {"init_from": {"drafter": name, "training": model.cfg.training}}
    return model


def split(examples: list[Example], val_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    idx = list(range(len(examples)))
    random.Random(seed).shuffle(idx)
    n_val = max(1, int(len(idx) * val_fraction)) if len(idx) >= 2 and val_fraction > 0 else 0
    return [examples[i] for i in idx[n_val:]], [examples[i] for i in idx[:n_val]]
