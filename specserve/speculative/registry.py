"""Build the configured drafter once, at start-up (one module per method)."""

from __future__ import annotations

from collections.abc import Callable

from specserve.errors import SpecserveError
from specserve.models.loader import LoadedModel, LoadOptions
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.drafter import Drafter


def _ngram(spec: SpeculativeConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.speculative.ngram import NgramDrafter

    return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)


def _draft_model(spec: SpeculativeConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.speculative.draft_model import DraftModelDrafter

    return DraftModelDrafter.build(spec, target, options, ecfg, max_model_len)


def _dflash(spec: SpeculativeConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.speculative.dflash import build

    return build(spec, target, options, ecfg, max_model_len)


def _mtp(spec: SpeculativeConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.speculative.mtp import build

    return build(spec, target, options, ecfg, max_model_len)


def _suffix(spec: SpeculativeConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.speculative.suffix import SuffixDrafter

    return SuffixDrafter.from_spec(spec)


def _chain(spec: SpeculativeConfig, target: LoadedModel, options: LoadOptions, ecfg, max_model_len: int) -> Drafter:
    from specserve.speculative.chain import ChainDrafter

    subs = [build_drafter(s, target, options, ecfg, max_model_len) for s in spec.drafters]
    return ChainDrafter(subs, [s.num_speculative_tokens for s in spec.drafters])


BUILDERS: dict[str, Callable[..., Drafter]] = {"ngram": _ngram, "draft_model": _draft_model, "dflash": _dflash,
                                               "mtp": _mtp, "suffix": _suffix, "chain": _chain}


def build_drafter(spec: SpeculativeConfig | None, target: LoadedModel, options: LoadOptions, ecfg,
                  max_model_len: int) -> Drafter | None:
    if spec is None:
        return None
    builder = BUILDERS.get(spec.method)
    if builder is None:
        raise SpecserveError(f"speculative method {spec.method!r} is not available in this build "
                             f"(available: {', '.join(BUILDERS)})")
    return builder(spec, target, options, ecfg, max_model_len)
