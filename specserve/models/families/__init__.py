"""Model families, registered by architecture name: one module per family owns its checkpoint
names and config fields (see :mod:`.base`). Adding a family: a module here, imported below."""

from specserve.errors import ModelLoadError
# each module registers its family on import, in this order (the order errors list them in)
from specserve.models.families import llama  # noqa: F401, I001
from specserve.models.families import qwen2  # noqa: F401
from specserve.models.families import qwen3  # noqa: F401
from specserve.models.families import gemma3  # noqa: F401
from specserve.models.families import qwen3_5  # noqa: F401
from specserve.models.families import qwen3_next  # noqa: F401
from specserve.models.families import qwen3_5_moe  # noqa: F401
from specserve.models.families.base import ModelFamily, families

__all__ = ["ModelFamily", "families", "family", "family_for_model_type"]


def family(arch: str | None, where: str = "") -> ModelFamily:
    """The family registered as ``arch`` (llama.cpp's GGUF architecture name)."""
    fams = families()
    if arch not in fams:
        raise ModelLoadError(f"unsupported architecture {arch!r}{' in ' + where if where else ''} "
                             f"(supported: {', '.join(fams)})")
    return fams[arch]


def family_for_model_type(model_type: str | None) -> ModelFamily:
    """The family of a config.json ``model_type``."""
    for fam in families().values():
        if model_type in fam.hf_model_types:
            return fam
    known = ", ".join(t for f in families().values() for t in f.hf_model_types)
    raise ModelLoadError(f"unsupported architecture {model_type!r} in config.json (supported: {known})")
