"""Llama, SmolLM2 and Mistral: the plain pre-norm decoder (GGUF stores q/k rows permuted)."""

from specserve.models.families.base import ModelFamily, register


def _hf_fields(read, kw: dict) -> dict:
    if read("sliding_window"):  # Mistral: every layer slides
        return dict(sliding_window=read("sliding_window"), layer_is_sliding=(True,) * kw["num_layers"])
    return {}


LLAMA = register(ModelFamily("llama", ("llama", "mistral"), hf_fields=_hf_fields, gguf_permute_qk=True))
