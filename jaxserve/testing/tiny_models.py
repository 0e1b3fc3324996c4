"""Tiny random-weight HF models with a real tokenizer, written to a local directory.

The PyTorch path needs torch (a test/bench extra); nothing here touches a model hub. A large
init scale keeps greedy choices away from near-ties, so parity tests are not flaky.
"""

from __future__ import annotations

import os

from jaxserve.models import registry

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_moe", "mixtral")
MODEL_TYPES = {"gemma3": "gemma3_text"}          # an arch here -> its HF model_type, where they differ

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
    """Save a tiny random HF model (safetensors) and its tokenizer under `path`; returns the path.

    `sliding_window`: Mistral's (default 4096) or the Gemma sliding layers' (default 8). The Gemma
    archs are always tied and get random norm weights (see _gemma_config)."""
    import torch

    tokenizer = make_tokenizer(vocab_size)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, initializer_range=init_range,
                  tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r} must be one of {ARCHITECTURES}")
    model_type = MODEL_TYPES.get(arch, arch)
    config_cls, cls = registry.transformers_classes(model_type)       # the registry's classes
    if arch == "mistral":
        common["sliding_window"] = sliding_window or 4096
    elif arch == "qwen3":
        common["head_dim"] = hidden_size // num_heads
    elif arch in ("gemma2", "gemma3"):
        common = _gemma_config(arch, common, num_layers, hidden_size // num_heads, sliding_window or 8)
    elif arch in ("qwen3_moe", "mixtral"):
        common = _moe_config(arch, common, num_layers, hidden_size // num_heads)
    config = config_cls(**common)
    torch.manual_seed(seed)
    model = cls(config).eval()
    if arch.startswith("gemma"):
        # HF initializes Gemma's (1 + weight) norms to zeros, the identity; random weights make a
        # norm applied wrongly (or not at all) show in the logits
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, init_range)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def _gemma_config(arch: str, common: dict, num_layers: int, head_dim: int, sliding_window: int) -> dict:
    """Gemma 2 (alternating sliding / global layers, both soft caps) or Gemma 3 text (5 sliding : 1
    global, two RoPE bases, linear scaling on the global one, q/k norms) config arguments, with a
    short window so it matters in short prompts and query_pre_attn_scalar = head_dim. Always tied,
    as Gemma is."""
    gemma = dict(common, head_dim=head_dim, sliding_window=sliding_window, query_pre_attn_scalar=head_dim,
                 hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    if arch == "gemma2":
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        return dict(gemma, layer_types=layer_types, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    # the 5 : 1 pattern, with a global layer inside even a 2-3 layer model
    layer_types = ["sliding_attention" if (i + 1) % 6 and i != num_layers - 1 else "full_attention"
                   for i in range(num_layers)]
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
    return dict(gemma, layer_types=layer_types, rope_parameters=rope)


def _moe_config(arch: str, common: dict, num_layers: int, head_dim: int) -> dict:
    """8 experts, top 2. Qwen3-MoE: experts of 32 columns, the last layer a dense MLP
    (mlp_only_layers) and top-k weights not renormalized (its config's default); Mixtral: every
    layer sparse, experts of intermediate_size, renormalized (always)."""
    if arch == "mixtral":
        return dict(common, num_local_experts=8, num_experts_per_tok=2)
    return dict(common, head_dim=head_dim, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                mlp_only_layers=[num_layers - 1] if num_layers > 1 else [], norm_topk_prob=False)


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


def hf_logprobs(path: str, token_ids: list[int]):
    """log_softmax of HF transformers' logits (fp32) at every position of `token_ids`: a float64
    numpy array [len, V]; row i is the distribution of token i + 1."""
    import torch

    model = _hf_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def hf_last_hidden_states(path: str, token_ids: list[int]):
    """HF transformers' (fp32) final hidden states of `token_ids`, after the model's final norm:
    `hidden_states[-1]` of output_hidden_states=True, a float64 numpy array [len, hidden_size]."""
    import torch

    model = _hf_model(path)
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].double().numpy()


_HF_CACHE: dict[str, object] = {}


def _hf_model(path: str):
    import torch
    import transformers

    if path not in _HF_CACHE:
        _HF_CACHE[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]
