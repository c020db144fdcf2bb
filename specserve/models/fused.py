"""The fused CPU decoder path: a stack of decoder layers in one C call (kernels/csrc/decoder.h).

``FusedStack`` holds, for one :class:`~specserve.models.transformer.Transformer`, the C
descriptors of its layers (weight pointers, formats, norms, rope tables) and of the KV pools it
writes; ``run`` executes layers ``l0 .. l1 - 1`` of a forward pass with one ``ss_decoder_layers``
call. The C code chains the same kernels the Python path (``DecoderLayer.forward``) calls one by
one, on the same shapes, so the results are bit-identical to it (tests/test_fused_decoder.py).

Covered: Llama / SmolLM2 / Mistral / Qwen2 (q/k/v biases) / Qwen3 (qk-norm) / Gemma 3, any weight format,
fused or separate q/k/v and gate/up weights, sliding layers that share the global block tables,
sliding layers with their own pools (a second ``Paging`` group), every KV cache dtype (the C code
quantizes a written row to the bits of ``ops.kv_quantize``, the Python path's write). Everything
else falls back to the Python path (``unsupported`` / ``batch_supported`` say why): CUDA,
non-fp32 activations, the torch kernel fallback. Gemma 3 runs fused too: its post-attention and
post-FFN norms and its sliding layers' own rope base are part of each layer's descriptor.

The descriptors are built on the first fused forward: linears replaced on the layers after that
need ``model._stack = None``; a switched ``int_dot`` is picked up by itself.
"""

from __future__ import annotations

import ctypes
import weakref
from operator import attrgetter
from typing import TYPE_CHECKING

import torch

from specserve.kernels import ops

if TYPE_CHECKING:
    from specserve.models.kv_cache import KVCache
    from specserve.models.transformer import ForwardBatch, Paging, Transformer


_INT_DOT = attrgetter("int_dot")


def unsupported(model: Transformer) -> str | None:
    """Why the model's layers cannot run fused (None: they can)."""
    cfg = model.cfg
    if not all(hasattr(layer, "fused_parts") for layer in model.layers):
        return "layers the C stack does not know"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return "CPU float32 only"
    if cfg.activation not in ops.ACTIVATIONS:
        return f"activation {cfg.activation}"
    if cfg.head_dim % 2:
        return "odd head_dim"
    return None


def _paging_ok(tables: torch.Tensor | None, slots: torch.Tensor | None, t: int) -> bool:
    return (tables is not None and slots is not None and tables.dtype == torch.int32 and tables.dim() == 2
            and tables.is_contiguous() and tables.device.type == "cpu" and slots.dtype == torch.int64
            and slots.shape == (t,) and slots.is_contiguous())


def batch_supported(batch: ForwardBatch, kv: KVCache) -> bool:
    """Whether this batch and cache can run fused (cheap checks, once per forward)."""
    t = batch.positions.shape[0]
    return (t > 0 and batch.positions.dtype == torch.int32 and batch.positions.is_contiguous()
            and batch.positions.device.type == "cpu" and batch.seq_ids.dtype == torch.int32
            and batch.seq_ids.shape == (t,) and batch.seq_ids.is_contiguous()
            and 1 <= len(batch.paging) <= 2 and all(_paging_ok(p.block_tables, p.slot_mapping, t) for p in batch.paging)
            and len(batch.paging) == 1 + max(kv.groups, default=0))  # the C call takes one or two groups


def _pool_ok(t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous() and t.device.type == "cpu"


def _norm_ptr(w: torch.Tensor | None, n: int) -> int | None:
    if w is None:
        return None
    if not (w.dtype == torch.float32 and w.shape == (n,) and w.is_contiguous()):
        raise ValueError(f"fused layers: norm weight must be a contiguous float32 [{n}] tensor")
    return w.data_ptr()


def _layer_struct(parts: dict, cfg, rope: tuple[int, int] | None) -> ops.SSLayer:
    """SSLayer of one layer from its declared parts (DecoderLayer.fused_parts); rope: pointers to
    the layer's own cos / sin table (None: the model's)."""
    s = ops.SSLayer()
    lins = parts["linears"]
    for j, name in enumerate(ops.LIN_SLOTS):
        if name in lins:
            s.lin[j] = ops.lin_struct(lins[name].weight, lins[name].bias)
    widths = {"q_norm": cfg.head_dim, "k_norm": cfg.head_dim}
    for name, w in parts["norms"].items():
        setattr(s, name, _norm_ptr(w, widths.get(name, cfg.hidden_size)))
    s.window = parts["window"]
    if rope is not None:
        s.rope_cos, s.rope_sin = rope
    return s


def _rows(batch: ForwardBatch, paging: Paging) -> ops.SSRows:
    """SSRows of the batch with one pool's block tables [S, max_blocks] and slots [T]."""
    tables = paging.block_tables
    return ops.SSRows(batch.positions.shape[0], batch.positions.data_ptr(), batch.seq_ids.data_ptr(),
                      paging.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[0], tables.shape[1])


def model_desc(cfg, rope) -> tuple[ops.SSModel, list[torch.Tensor]]:
    """The SSModel of a config and its global rope table, and the table's cos / sin [max_pos, D / 2]
    (the descriptor holds their pointers: keep them)."""
    cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
    return ops.SSModel(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                       cfg.rms_eps, cfg.scale, cfg.attn_softcap, ops.ACTIVATIONS[cfg.activation], cos.data_ptr(),
                       sin.data_ptr(), cos.shape[0]), [cos, sin]


class FusedStack:
    """C descriptors of one model's decoder layers, and the call that runs them."""

    unsupported = staticmethod(unsupported)  # (model) -> why it cannot run fused, or None
    batch_supported = staticmethod(batch_supported)  # (batch, kv) -> whether this forward can

    def __init__(self, model: Transformer, lib):
        self._parts = [layer.fused_parts() for layer in model.layers]  # the declared stack
        rope = model.rope_global
        self.model_desc, self._keep = model_desc(model.cfg, rope)  # _keep: tensors whose pointers it holds
        self._ropes = [None if p["rope"] is rope else self._own_rope(p["rope"], self._keep[0].shape)
                       for p in self._parts]
        self._setup(model, lib, self.model_desc, [lin for p in self._parts for lin in p["linears"].values()])

    def _setup(self, model: Transformer, lib, desc: ops.SSModel, lins: list) -> None:
        """What every stack holds beside its descriptors: the library, the sizes, the caches of the
        layer and pool arrays, and under tensor parallelism the reduce callback in ``desc``. lins:
        the linears the layer descriptors describe (a switched int_dot of theirs rebuilds them)."""
        cfg = model.cfg
        self.lib, self.num_layers, self.hidden, self._cfg = lib, cfg.num_layers, cfg.hidden_size, cfg
        self._dot_weights = [lin.weight for lin in lins if hasattr(lin.weight, "int_dot")]
        self._layers_key: tuple | None = None
        self._layers = None
        self._kv_ref = None
        self._pools = None
        self._reduce_errors: list[BaseException] = []  # (a list, not self: the callback keeps no cycle)
        if model.tp is not None:  # the row-parallel partial sums, summed over the ranks inside the call
            self._reduce = ops.REDUCE_FN(_reduce_callback(model.tp, self._reduce_errors))
            desc.reduce = self._reduce

    def _own_rope(self, rope, shape) -> tuple[int, int]:
        """Pointers to a layer's own rope table (Gemma 3's local base), kept alive by the stack."""
        cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
        if cos.shape != shape:
            raise ValueError("fused layers: a layer's own rope table must have the model's shape")
        self._keep += [cos, sin]
        return cos.data_ptr(), sin.data_ptr()

    def __deepcopy__(self, memo) -> None:
        """A copied model must not reuse raw pointers into the original's tensors: it rebuilds."""
        return None

    def _act_key(self) -> tuple:
        """Which linears take the integer-dot path (a weight's int_dot may be switched at run time)."""
        return tuple(map(_INT_DOT, self._dot_weights))

    def _layer_array(self):
        key = self._act_key()
        if key != self._layers_key:
            arr = (ops.SSLayer * self.num_layers)()
            for i, parts in enumerate(self._parts):
                arr[i] = _layer_struct(parts, self._cfg, self._ropes[i])
            self._layers, self._layers_key = arr, key
        return self._layers

    def _pool_array(self, kv: KVCache):
        """SSKVPool per layer for this cache (rebuilt when another cache comes)."""
        if self._kv_ref is not None and self._kv_ref() is kv:
            return self._pools
        cfg = self._cfg
        if kv.num_layers != self.num_layers:
            raise ValueError(f"KV cache has {kv.num_layers} layers, the model {self.num_layers}")
        fmt, dtype = ops.KV_FORMATS[kv.kv_dtype]
        d = cfg.head_dim
        sshape = ops.kv_scale_shape(kv.kv_dtype, d)
        arr = (ops.SSKVPool * self.num_layers)()
        for i, (k, v) in enumerate(zip(kv.k, kv.v)):
            want = (k.shape[0], k.shape[1], cfg.num_kv_heads, ops.kv_store_dim(kv.kv_dtype, d))
            scales = (None, None) if sshape is None else (kv.k_scales[i], kv.v_scales[i])
            if not (all(_pool_ok(p, want, dtype) for p in (k, v))
                    and all(s is None or _pool_ok(s, want[:3] + sshape, torch.float32) for s in scales)):
                raise ValueError(f"fused layers: KV pools of layer {i} must be contiguous {kv.kv_dtype} CPU tensors "
                                 f"{list(want)} (scales {list(want[:3] + (sshape or ()))})")
            sp = [None if s is None else s.data_ptr() for s in scales]
            arr[i] = ops.SSKVPool(k.data_ptr(), v.data_ptr(), sp[0], sp[1], k.shape[0], k.shape[1], fmt,
                                  ops.kv_c_group(kv.kv_dtype, d), kv.group(i))
        self._kv_ref, self._pools = weakref.ref(kv), arr
        return arr

    def run(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> dict[int, torch.Tensor]:
        """Layers 0 .. num_layers - 1 on x [T, H] (in place). Returns {layer: [T, H] copy} for the
        layers in batch.hidden_layers (the stack runs in segments that end at those layers, and at
        the layers in self.breaks)."""
        if not (x.dtype == torch.float32 and x.is_contiguous() and x.shape[1:] == (self.hidden,)):
            raise ValueError(f"fused layers: x must be a contiguous float32 [T, {self.hidden}] tensor")
        call = self._prepare(batch, kv, x)
        hidden: dict[int, torch.Tensor] = {}
        wanted = {i for i in batch.hidden_layers if 0 <= i < self.num_layers}
        start = 0
        for last in sorted(wanted | self.breaks | {self.num_layers - 1}):
            call(start, last + 1)
            if last in self.breaks:
                self._after(last, x)
            if last in wanted:
                hidden[last] = x.clone()
            start = last + 1
        return hidden

    breaks: frozenset[int] = frozenset()  # layers after which the stack returns to Python (_after)

    def _after(self, layer: int, x: torch.Tensor) -> None:
        """What Python adds to x after layer ``layer`` (in self.breaks) ran in C: nothing here."""

    def _prepare(self, batch: ForwardBatch, kv: KVCache, x: torch.Tensor):
        """fn(l0, l1) running layers l0 .. l1 - 1 of this forward on x."""
        layers, pools = self._layer_array(), self._pool_array(kv)
        rows = _rows(batch, batch.paging[0])
        wrows = _rows(batch, batch.paging[1]) if len(batch.paging) > 1 else None  # the sliding layers' pool
        return lambda l0, l1: self._layers_call(layers, pools, l0, l1, rows, wrows, x)

    def _layers_call(self, layers, pools, l0: int, l1: int, rows, wrows, x: torch.Tensor) -> None:
        self._reduced(ops.decoder_layers, self.lib, self.model_desc, layers, pools, l0, l1, rows, wrows, x)

    def _reduced(self, call, *args) -> None:
        """call(*args), a failed tensor-parallel reduce inside it raised as itself."""
        try:
            call(*args)
        except RuntimeError:
            if self._reduce_errors:
                raise self._reduce_errors.pop() from None
            raise


def _reduce_callback(tp, errors: list):
    """The C stack's reduce: x [n] (a raw pointer) summed over the ranks in place; a failure is
    kept in errors and re-raised once the C call returns."""
    def reduce(ptr: int, n: int, _ctx) -> int:
        try:
            tp.all_reduce(torch.frombuffer((ctypes.c_float * n).from_address(ptr), dtype=torch.float32))
            return 0
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            return 1
    return reduce

