"""Build the configured drafter once, at start-up (one module per method)."""

from __future__ import annotations

from collections.abc import Callable

from specserve.errors import SpecserveError
from specserve.models.loader import LoadedModel, LoadOptions
from specserve.spec.config import SpecConfig
from specserve.spec.drafter import Drafter


def _ngram(spec: SpecConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.spec.ngram import NgramDrafter

    return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)


def _draft_model(spec: SpecConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.spec.draft_model import DraftModelDrafter

    return DraftModelDrafter.build(spec, target, options, ecfg, max_model_len)


def _dflash(spec: SpecConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.spec.dflash import build

    return build(spec, target, options, ecfg, max_model_len)


def _mtp(spec: SpecConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.spec.mtp import build

    return build(spec, target, options, ecfg, max_model_len)


def _suffix(spec: SpecConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.spec.suffix import SuffixDrafter

    return SuffixDrafter.from_spec(spec)


def _chain(spec: SpecConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.spec.chain import ChainDrafter

    subs = [build_drafter(s, target, options, ecfg, max_model_len) for s in spec.drafters]
    return ChainDrafter(subs, [s.num_speculative_tokens for s in spec.drafters])


BUILDERS: dict[str, Callable[..., Drafter]] = {"ngram": _ngram, "draft_model": _draft_model, "dflash": _dflash,
                                               "mtp": _mtp, "suffix": _suffix, "chain": _chain}


def build_drafter(spec: SpecConfig | None, target: LoadedModel, options: LoadOptions, ecfg,
                  max_model_len: int) -> Drafter | None:
    if spec is None:
        return None
    builder = BUILDERS.get(spec.method)
    if builder is None:
        raise SpecserveError(f"speculative method {spec.method!r} is not available in this build "
                             f"(available: {', '.join(BUILDERS)})")
    return builder(spec, target, options, ecfg, max_model_len)
