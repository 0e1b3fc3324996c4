"""Fixtures: a tiny random HF model directory (built once) and a fake jaxserve LLM."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fake_llm import FakeLLM, FakeParams  # noqa: E402
from tiny_model import make_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def fake_jaxserve(monkeypatch: pytest.MonkeyPatch) -> list[FakeLLM]:
    """Routes the jaxserve backend to FakeLLM; returns the list of LLMs it built."""
    from jaxserve.bench import backend_jaxserve

    built: list[FakeLLM] = []

    def load(model_path: str, kwargs: dict, progress: bool = True) -> FakeLLM:
        llm = FakeLLM(model_path, **kwargs)
        llm.progress = progress
        built.append(llm)
        return llm

    monkeypatch.setattr(backend_jaxserve, "load_llm", load)
    monkeypatch.setattr(backend_jaxserve, "sampling_params", lambda **kw: FakeParams(**kw))
    return built


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
