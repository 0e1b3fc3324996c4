"""The llamacpp bench backend: a clear skip where llama-cpp-python is missing or the model is not a
GGUF, and (where the optional extra is installed) batch-1 greedy runs on the embedded GGUF whose
tokens mostly agree with jaxserve's on the same file."""

import sys

import pytest

from jaxserve.bench.backend_base import RunOptions, UnsupportedBackend
from jaxserve.bench.model_files import ModelSpec, resolve_model
from jaxserve.bench.workloads import BenchRequest


def test_without_llama_cpp_python_the_backend_is_skipped_with_how_to_install_it(monkeypatch):
    from jaxserve.bench.backend_llamacpp import LlamaCppBackend

    monkeypatch.setitem(sys.modules, "llama_cpp", None)        # import fails as if not installed
    with pytest.raises(UnsupportedBackend, match=r"pip install -e \.\[llamacpp\]"):
        LlamaCppBackend(ModelSpec("/m.gguf", "gguf", "/", "m.gguf"))


def test_a_hugging_face_directory_is_refused(tmp_path):
    from jaxserve.bench.backend_llamacpp import LlamaCppBackend

    with pytest.raises(UnsupportedBackend, match="GGUF"):
        LlamaCppBackend(ModelSpec(str(tmp_path), "hf", str(tmp_path), None))


def test_batch_one_greedy_runs_on_the_embedded_gguf():
    pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed (not part of the test set-up)")
    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.backend_llamacpp import LlamaCppBackend

    spec = resolve_model(None)
    backend = LlamaCppBackend(spec, max_seq_len=256)
    prompt = tuple(backend.llm.tokenize(b"The capital of France is", add_bos=False))
    requests = [BenchRequest("a", prompt, 12), BenchRequest("b", prompt[:3], 5)]
    run = backend.run(requests, RunOptions(progress=False))
    assert [r.output_len for r in run.records] == [12, 5]
    assert all(len(r.token_times) == r.output_len for r in run.records)
    ours = LLM(spec.path, max_model_len=256, max_num_seqs=2, progress=False).generate(
        [{"prompt_token_ids": list(prompt)}], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    # llama.cpp multiplies Q4_1 blocks by 8-bit activations, jaxserve dequantized float32: the
    # first tokens agree, later ones may drift
    assert run.output_token_ids["a"][:3] == list(ours[:3])
