"""Tiny random-weight HF models with a real tokenizer, written to a local directory.

The PyTorch path needs torch (a test/bench extra); nothing here touches a model hub. A large
init scale keeps greedy choices away from near-ties, so parity tests are not flaky.
"""

from __future__ import annotations

import os

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

_TRAINING_TEXT = [
    "The tide comes in twice a day, pulled by the moon and the sun.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching lets new requests join while others decode.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026.",
    "Unicode: café, naïve, 東京, emoji 🙂.",
]


def make_tokenizer(vocab_size: int = 320):
    # the same byte-level BPE as the bench's random models, trained on this module's text
    from jaxserve.bench.random_model import bpe_tokenizer, fast_tokenizer

    fast = fast_tokenizer(bpe_tokenizer(_TRAINING_TEXT * 4, vocab_size))
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    return fast


def make_tiny_model(path: str | os.PathLike, arch: str = "llama", *, seed: int = 0, num_layers: int = 2,
                    hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 320,
                    intermediate_size: int = 128, init_range: float = 0.2, tie_word_embeddings: bool = False,
                    max_position_embeddings: int = 1024, sliding_window: int | None = None) -> str:
    """Save a tiny random HF model (safetensors) and its tokenizer under `path`; returns the path."""
    import torch
    import transformers

    tokenizer = make_tokenizer(vocab_size)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, initializer_range=init_range,
                  tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=sliding_window or 4096)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=hidden_size // num_heads)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(f"arch={arch!r} must be one of {ARCHITECTURES}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def make_tiny_repeating_model(path: str | os.PathLike, *, seed: int = 0, residual_scale: float = 0.3,
                              logit_scale: float = 4.0) -> str:
    """A tiny random Llama whose outputs often repeat, as text that quotes its context does, so
    speculative guesses are sometimes right and sometimes wrong: tied embeddings read the input
    token back out, and attention and MLP outputs scaled by `residual_scale` only sometimes move
    the prediction away from it. The final norm's weight scaled by `logit_scale` keeps greedy
    choices away from near-ties (float rounding differs between batch shapes)."""
    import torch
    import transformers

    make_tiny_model(path, "llama", seed=seed, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
        model.model.norm.weight.mul_(logit_scale)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF transformers on PyTorch (fp32); EOS is banned until
    max_new_tokens (min_new_tokens), like SamplingParams(min_tokens=max_tokens)."""
    import torch

    model = _hf_model(path)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


_HF_CACHE: dict[str, object] = {}


def _hf_model(path: str):
    import torch
    import transformers

    if path not in _HF_CACHE:
        _HF_CACHE[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]
