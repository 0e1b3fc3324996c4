"""The embedded SmolLM2-135M-Instruct: greedy generations token-identical to HF transformers
loaded from the same GGUF file (fp32 on both sides)."""

import os

import pytest

from jaxserve import LLM, SamplingParams

QUESTIONS = [
    "Tell me about tides.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "How do plants make food?",
    "Give me a Python function that adds two numbers.",
    "Why is the sky blue?",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    # 8 seats and a 256-token budget: two step shapes and their samplers to compile.
    return LLM(None, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, num_kv_blocks=128,
               decode_buckets=(8,), prefill_buckets=(0, 16), compilation_cache_dir="", progress=False)


@pytest.fixture(scope="module")
def hf_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxserve.checkpoints import embedded_model_path

    path = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    return model


@pytest.mark.slow   # the embedded model and HF side by side (~2 min on 2 cores); every architecture's tiny parity runs by default
def test_greedy_generations_match_hf_transformers_on_the_embedded_model(llm, hf_model):
    import torch

    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(convs, SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False)
    for q, out in zip(QUESTIONS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id or 0)
        want = ref[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want, q
    assert any("Paris" in o.outputs[0].text for o in outs)   # the model really answers
    s = llm.stats()
    assert s.steps.num_compilations_after_warmup == 0
    assert s.scheduler.num_running == 0 and s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total


REPETITIVE = [
    "Repeat this sentence three times: The quick brown fox jumps over the lazy dog.",
    "Correct the spelling and write the text out again: Twice a day the sea climbs the baech and twice a day "
    "it leaves agian. The pull of the moon raises a bulge of wtaer on the side of the earth that faces it.",
]


@pytest.mark.slow
def test_speculative_decoding_keeps_greedy_generations_identical_to_hf(llm, hf_model):
    """n-gram speculation on a runner whose 8 decode rows hold two requests with 3 guesses each:
    on prompts whose answers copy their text (guesses accepted) and on ones whose answers don't."""
    import torch

    tok = llm.get_tokenizer()
    spec = LLM.sharing_runner(llm, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "adaptive": False})
    greedy = SamplingParams(max_tokens=48, min_tokens=48, temperature=0.0)
    questions = REPETITIVE + QUESTIONS[:2]
    for pair in (questions[:2], questions[2:]):
        outs = spec.chat([[{"role": "user", "content": q}] for q in pair], greedy, use_tqdm=False)
        for q, out in zip(pair, outs):
            ids = torch.tensor([out.prompt_token_ids])
            with torch.no_grad():
                ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                                        min_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id or 0)
            assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), q
    s = spec.stats()
    assert s.scheduler.spec_num_accepted_tokens > 0 and s.scheduler.spec_mean_accepted > 0.5   # the copying answers were guessed
    assert s.steps.num_compilations_after_warmup == 0
    assert s.scheduler.num_running == 0 and s.scheduler.num_kv_blocks_free + s.scheduler.num_kv_blocks_cached == s.scheduler.num_kv_blocks_total
