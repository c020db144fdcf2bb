"""Tokenizers from GGUF metadata or tokenizer.json, through the `tokenizers` library.

A GGUF's vocabulary is converted once with transformers' GGUF converter and the result
is cached as tokenizer.json, so later starts need only `tokenizers`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from gguf.vocab import bytes_to_unicode
from tokenizers import Tokenizer as HFTokenizer

from specserve.errors import ModelLoadError

# tokens that end a turn in the chat formats we know (llama.cpp calls them end-of-generation)
_EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<eos>", "</s>", "<|eot_id|>",
               "<|end_of_text|>", "<|end|>")


@dataclass
class Tokenizer:
    """Encode/decode plus the special tokens and chat template of one model."""

    backend: HFTokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    _bytes: dict[int, bytes] = field(default_factory=dict, repr=False)  # token_bytes, per token asked
    _decoder: str | None = field(default="", repr=False)  # the decoder's kind ("": not read yet)
    _byte_of: tuple | None = field(default=None, repr=False)  # byte-level BPE: str.translate tables (char -> byte; drop)
    _plain: HFTokenizer | None = field(default=None, repr=False)  # a copy that reads special tokens as text

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """``text`` with its special tokens' spellings read as plain text ("<|im_start|>" as the
        characters, not the token): llama-server's /tokenize with parse_special false. A copy of the
        backend does it, so the shared one never changes under another caller."""
        if self._plain is None:
            plain = HFTokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self.backend.id_to_token(int(i)) or ""

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` adds to the text (OpenAI's logprobs ``bytes``): decoding one token
        alone gives U+FFFD where it holds part of a multi-byte character (an emoji's first bytes), and
        these put the character back together when joined. A byte-level BPE token's bytes; under a
        SentencePiece decoder a byte-fallback token's byte (``<0xF0>``), else its text with the word
        marker as a space; an added token's text; any other decoder's text of the token alone."""
        i = int(i)
        if i not in self._bytes:
            self._bytes[i] = self._token_bytes(i)
        return self._bytes[i]

    def all_token_bytes(self) -> list[bytes]:
        """``token_bytes`` of every id, in id order (one pass: a grammar engine's vocabulary)."""
        added = self.backend.get_added_tokens_decoder()
        pieces = {i: t for t, i in self.backend.get_vocab(with_added_tokens=True).items()}
        return [self._token_bytes(i, pieces.get(i, ""), added) for i in range(self.vocab_size)]

    def text_only(self) -> HFTokenizer:
        """A copy of the backend without its added tokens: text that spells one ("<tool_call>",
        "<|im_end|>") is read as the characters, as a grammar forcing that text must write it."""
        spec = json.loads(self.backend.to_str())
        spec["added_tokens"] = []
        return HFTokenizer.from_str(json.dumps(spec))

    def _token_bytes(self, i: int, piece: str | None = None, added: dict | None = None) -> bytes:
        piece = self.id_to_token(i) if piece is None else piece
        added = (self.backend.get_added_tokens_decoder() if added is None else added).get(i)
        kind = self._decoder_kind()
        if added is not None or kind is None:
            return (added.content if added is not None else self.decode([i], skip_special_tokens=False)).encode()
        if kind == "byte_level":
            if self._byte_of is None:  # str.translate: a piece in C, not char by char (all_token_bytes)
                chars = {c: chr(b) for b, c in bytes_to_unicode().items()}
                self._byte_of = (str.maketrans(chars), str.maketrans(dict.fromkeys(chars)))
            to_bytes, drop = self._byte_of
            if not piece.translate(drop):  # every char one byte's
                return piece.translate(to_bytes).encode("latin-1")
            return piece.encode()
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()

    def _decoder_kind(self) -> str | None:
        """"byte_level", "sentencepiece" (a word marker and byte fallback) or None (read once)."""
        if self._decoder == "":
            dec = json.loads(self.backend.to_str()).get("decoder") or {}
            types = {d.get("type") for d in dec.get("decoders", [dec])}
            self._decoder = ("byte_level" if "ByteLevel" in types else
                             "sentencepiece" if "ByteFallback" in types else None)
        return self._decoder

    def vocab_fingerprint(self) -> list[str]:
        """Tokens in id order: two models can share drafts only if these agree."""
        return [self.id_to_token(i) for i in range(self.vocab_size)]


def _eog_ids(backend: HFTokenizer, eos_token: str | None, eos_id: int | None) -> frozenset[int]:
    """The EOS token, plus each known end-of-turn token that the vocabulary marks special: "</s>" is
    ordinary text in Qwen2.5's and Gemma 3's vocabularies (an HTML tag) and must not end a generation,
    as their generation configs say (llama.cpp stops on it there; transformers and vLLM do not)."""
    ids = {eos_id} if eos_id is not None else set()
    if eos_token and backend.token_to_id(eos_token) is not None:
        ids.add(backend.token_to_id(eos_token))
    special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    ids.update(special[tok] for tok in _EOG_TOKENS if tok in special)
    return frozenset(i for i in ids if i is not None)


def from_gguf(path: Path, cache_dir: Path | None) -> Tokenizer:
    """Convert the GGUF's tokenizer (cached as tokenizer.json under cache_dir)."""
    tok_file = cache_dir / "tokenizer.json" if cache_dir else None
    meta_file = cache_dir / "tokenizer_meta.json" if cache_dir else None
    if tok_file and tok_file.exists() and meta_file.exists():
        meta = json.loads(meta_file.read_text())
        backend = HFTokenizer.from_file(str(tok_file))
    else:
        backend, meta = _convert_gguf(path)
        if cache_dir:
            cache_dir.mkdir(parents=True, exist_ok=True)
            backend.save(str(tok_file))
            meta_file.write_text(json.dumps(meta))
    return Tokenizer(backend, meta.get("chat_template"), meta.get("bos_token"), meta.get("eos_token"),
                     bool(meta.get("add_bos_token")),
                     _eog_ids(backend, meta.get("eos_token"), meta.get("eos_token_id")))


def _convert_gguf(path: Path) -> tuple[HFTokenizer, dict]:
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as exc:
        raise ModelLoadError("converting a GGUF tokenizer needs the `transformers` package "
                             "(pip install transformers)") from exc
    try:
        arch, tok_dict, tok_config = get_gguf_tokenizer(str(path))
        backend, _extra = convert_gguf_tokenizer(arch, tok_dict)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"cannot build a tokenizer from {path}: {exc}") from exc
    meta = {k: tok_config.get(k) for k in ("chat_template", "bos_token", "eos_token", "add_bos_token")}
    meta["eos_token_id"] = tok_dict.get("eos_token_id")
    return backend, meta


def from_hf_dir(directory: Path) -> Tokenizer:
    tok_file = directory / "tokenizer.json"
    if not tok_file.exists():
        raise ModelLoadError(f"{directory} has no tokenizer.json")
    backend = HFTokenizer.from_file(str(tok_file))
    cfg_file = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    template = cfg.get("chat_template")
    if (directory / "chat_template.jinja").exists():
        template = (directory / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

    def tok_str(v):
        return v.get("content") if isinstance(v, dict) else v

    bos, eos = tok_str(cfg.get("bos_token")), tok_str(cfg.get("eos_token"))
    eos_id = backend.token_to_id(eos) if eos else None
    return Tokenizer(backend, template, bos, eos, bool(cfg.get("add_bos_token", False)),
                     _eog_ids(backend, eos, eos_id))
