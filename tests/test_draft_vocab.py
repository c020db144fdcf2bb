"""The draft vocabulary: frequency-ranked ids, a cut LM head whose logits equal the full head's."""

import torch

from specserve.models.loader import LoadOptions, load_model
from specserve.speculative.draft_vocab import DraftVocab, frequent_ids, token_counts


def _smollm2():
    return load_model("smollm2-135m", LoadOptions("cpu", "auto", "q4_0"))


def test_frequent_ids_are_the_most_counted_plus_special_tokens(tmp_path):
    m = _smollm2()
    tok = m.tokenizer
    counts = token_counts(tok, tmp_path)
    assert counts.shape == (tok.vocab_size,) and counts.sum() > 500_000  # about 1M tokens of stdlib source
    assert list((tmp_path / "draft_vocab").glob("*.pt"))  # cached per tokenizer
    ids = frequent_ids(tok, 1000, tmp_path)
    assert ids.shape == (1000,) and torch.equal(ids, torch.sort(ids).values)
    assert set(tok.eos_token_ids) <= set(ids.tolist())
    assert int(counts.argmax()) in ids.tolist()
    kept = counts[ids]
    left = counts.clone()
    left[ids] = -1
    special = len(set(tok.eos_token_ids) | set(tok.backend.get_added_tokens_decoder()))
    # apart from the special tokens, nothing left out was counted more often than what was kept
    assert int((left > torch.sort(kept).values[special]).sum()) == 0
    assert torch.equal(frequent_ids(tok, 10 ** 9, tmp_path), torch.arange(tok.vocab_size))


def test_cut_head_logits_equal_the_full_head_and_grow_with_added_tokens(tmp_path):
    m = _smollm2()
    model = m.model
    ids = frequent_ids(m.tokenizer, 2000, tmp_path)
    vocab = DraftVocab(model, ids)
    h = torch.randn(3, m.config.hidden_size)
    full = model.logits(h)  # [3, V]
    cut = vocab.logits(h)
    assert torch.equal(cut[:, ids], full[:, ids])  # the same rows, the same bits
    outside = torch.ones(full.shape[1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(cut[:, outside]).all()
    rare = int(torch.nonzero(outside)[-1])
    vocab.add([rare, int(ids[0])])
    grown = vocab.logits(h)
    assert vocab.size == 2001
    assert torch.equal(grown[:, rare], full[:, rare]) and torch.equal(grown[:, ids], full[:, ids])


def test_draft_vocab_and_quantization_keys_are_validated():
    import pytest

    from specserve.errors import SpecserveError
    from specserve.speculative.config import parse_speculative_config

    ok = parse_speculative_config('{"method": "draft_model", "model": "m", "quantization": "q4_0", "draft_vocab_size": 32768}')
    assert ok.quantization == "q4_0" and ok.draft_vocab_size == 32768 and ok.draft_p_min == 0.0
    assert parse_speculative_config('{"method": "dflash", "model": "m", "draft_p_min": 0.75}').draft_p_min == 0.75
    for bad, says in (('{"method": "ngram", "draft_vocab_size": 1000}', "draft_model"),
                      ('{"method": "draft_model", "model": "m", "draft_vocab_size": 10}', ">= 256"),
                      ('{"method": "draft_model", "model": "m", "draft_vocab_size": "big"}', "draft_vocab_size"),
                      ('{"method": "draft_model", "model": "m", "quantization": "q3"}', "q3"),
                      ('{"method": "ngram", "draft_p_min": 0.5}', "draft_p_min applies to"),
                      ('{"method": "dflash", "model": "m", "draft_p_min": 1}', r"draft_p_min must be in \[0, 1\)"),
                      ('{"method": "dflash", "model": "m", "draft_p_min": true}', "must be a number"),
                      ('{"method": "ngram", "adaptive": 1}', "must be bool")):
        with pytest.raises(SpecserveError, match=says):
            parse_speculative_config(bad)


def test_a_draft_model_vocab_size_above_its_vocabulary_is_an_error():
    """It was ignored silently (the full head); now the config's mistake is named."""
    import pytest

    from specserve.engine.config import EngineConfig
    from specserve.errors import SpecserveError
    from specserve.speculative.config import SpeculativeConfig
    from specserve.speculative.registry import build_drafter

    target = _smollm2()
    spec = SpeculativeConfig("draft_model", model="smollm2-135m", quantization="q4_0", draft_vocab_size=60000)
    with pytest.raises(SpecserveError, match="draft_vocab_size 60000 is larger .*49152 tokens"):
        build_drafter(spec, target, LoadOptions("cpu", "auto", "q4_0"), EngineConfig(), 256)


def test_draft_vocab_size_applies_to_model_drafters_only():
    import pytest

    from specserve.errors import SpecserveError
    from specserve.speculative.config import SpeculativeConfig

    for method in ("draft_model", "dflash", "mtp"):
        assert SpeculativeConfig(method, model="x", draft_vocab_size=4096).draft_vocab_size == 4096
    for method in ("ngram", "suffix"):
        with pytest.raises(SpecserveError, match='applies to methods "draft_model", "dflash" and "mtp" only'):
            SpeculativeConfig(method, draft_vocab_size=4096)
