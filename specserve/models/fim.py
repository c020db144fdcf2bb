"""Fill-in-the-middle: a code model's infill tokens, and the prompt that asks for the middle.

Code models trained for infilling (Qwen2.5-Coder, StarCoder, DeepSeek-Coder, Code Llama, ...) read
``<prefix-token> before-the-cursor <suffix-token> after-the-cursor <middle-token>`` and write what
goes between (prefix-suffix-middle order, the one these models share), ending with EOS or their
pad / file-separator token. The tokens are found by their spellings among the vocabulary's added
tokens, as llama.cpp finds them when a GGUF does not name them.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.models.tokenizer import Tokenizer

_SPELLINGS = {
    "prefix": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<｜fim▁begin｜>", "<PRE>"),
    "suffix": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<｜fim▁hole｜>", "<SUF>"),
    "middle": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<｜fim▁end｜>", "<MID>"),
    "pad": ("<|fim_pad|>", "<fim_pad>", "<fim-pad>"),
    "repo": ("<|repo_name|>", "<repo_name>", "<reponame>"),
    "file_sep": ("<|file_sep|>", "<file_sep>"),
}


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None  # the repository-level format (Qwen2.5-Coder): <repo>name, <file_sep>path\ntext ...
    file_sep: int | None = None

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Tokens that end an infill besides EOS: after them the model starts another file or pads."""
        return tuple(i for i in (self.pad, self.repo, self.file_sep) if i is not None)


def find_fim_tokens(tok: Tokenizer) -> FimTokens | None:
    """The infill tokens of ``tok``'s vocabulary, or None where it has no prefix/suffix/middle trio."""
    added = {t.content: i for i, t in tok.backend.get_added_tokens_decoder().items()}
    found = {role: next((added[s] for s in spellings if s in added), None) for role, spellings in _SPELLINGS.items()}
    if None in (found["prefix"], found["suffix"], found["middle"]):
        return None
    return FimTokens(**found)


def fim_prompt(fim: FimTokens, prefix: list[int], suffix: list[int], bos: int | None = None) -> list[int]:
    """[BOS] <prefix> prefix <suffix> suffix <middle>: the model continues with the middle."""
    head = [bos] if bos is not None else []
    return head + [fim.prefix, *prefix, fim.suffix, *suffix, fim.middle]
