"""Fixtures shared by the test modules.

``tiny_target``: a tiny random Llama with a byte-level tokenizer, built in the test process
(no download), for tests of the scheduler, the cache coordinator and speculation that need a
real model but not a real checkpoint. ``tiny_engine``: an engine over it. ``srv``: a live HTTP
server over a FakeEngine (live_server.py), one per test module; ``engine``: its engine, reset to
its defaults after each test. ``one_thread`` (the kernel tests opt in with ``pytestmark``): torch
and the C kernels single-threaded for the test, unless it sets a thread count itself.
``tiny_models`` / ``smollm2_quantized`` (the model-equivalence modules): kind -> a tiny random
checkpoint written by transformers, loaded by ours (and the transformers model); quantization ->
smollm2-135m loaded so; each built on first use, once per module (equivalence_utils.py).
``hybrid`` (the hybrid modules): the committed tiny Qwen3.5 checkpoint, ours and transformers'
model over the same files (hybrid_utils.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import make_tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture
def tiny_engine(tiny_target):
    from specserve.engine.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine

    def make(spec=None, drafter=None, **ecfg):
        ecfg.setdefault("max_model_len", 256)
        return LLMEngine(tiny_target, EngineConfig(**ecfg), spec, drafter)

    return make


@pytest.fixture(scope="module")
def srv():
    from live_server import make_server

    server = make_server()
    yield server
    server.close()


@pytest.fixture
def engine(srv):
    from fake_engine import SCRIPT

    yield srv.engine
    srv.engine.responder = lambda prompt, params: SCRIPT
    srv.engine.step_delay = 0.0
    srv.engine.fail_next = None
    srv.engine.no_steps = None


@pytest.fixture
def one_thread():
    """Single-threaded unless a test compares thread counts: the per-row torch fallback issues many
    tiny ops, and on an oversubscribed machine every OpenMP barrier can wait a whole scheduler slice."""
    import torch

    from kernel_utils import set_threads

    n = torch.get_num_threads()
    set_threads(1)
    yield
    torch.set_num_threads(n)
    set_threads(None)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from equivalence_utils import tiny_model_builder

    return tiny_model_builder(tmp_path_factory)


@pytest.fixture(scope="module")
def smollm2_quantized():
    from equivalence_utils import quantized_smollm2_builder

    return quantized_smollm2_builder()


@pytest.fixture(scope="module")
def hybrid():
    from hybrid_utils import load_hybrid

    return load_hybrid()


@pytest.fixture(scope="session")
def qwen3_5_moe(tmp_path_factory):
    """A tiny random Qwen3.5-MoE with an MTP head: (our LoadedModel, transformers' model)."""
    from tiny_models import make_tiny_qwen3_5_moe

    return make_tiny_qwen3_5_moe(tmp_path_factory.mktemp("tiny_qwen3_5_moe"))
