"""Tiny random-weight HF models of each architecture, built with torch, and their reference outputs.

Each model is built once per session: HF's greedy generation of NEW_TOKENS tokens and HF's logits
over that whole sequence (fp32 and bf16) are the references the parity tests compare against.
initializer_range=0.2 keeps the logits spread out (std about 1.5), so greedy choices are not
near-ties; the tests check the top-1/top-2 gap rather than trust it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

PROMPT_LEN = 12
NEW_TOKENS = 16
SEQ_LEN = PROMPT_LEN + NEW_TOKENS

_COMMON = dict(
    vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

# name -> (transformers config class name, torch seed, overrides); together they cover every
# config flag. Seeds are chosen so every greedy step's top-1/top-2 gap is above 0.02.
ARCHITECTURES = {
    # Llama-3 rope scaling with an original context of 64 puts head_dim 16's frequencies in
    # all three bands (kept, interpolated, divided by factor)
    "llama3_untied": ("LlamaConfig", 1, dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    "smollm2_tied": ("LlamaConfig", 0, dict(tie_word_embeddings=True, rms_norm_eps=1e-5,
                                         rope_parameters=dict(rope_type="default",
                                                              rope_theta=100000.0))),
    # a window of 6 tokens, far shorter than the 28-token sequence
    "mistral_sliding": ("MistralConfig", 1, dict(tie_word_embeddings=False, sliding_window=6,
                                              head_dim=16)),
    "qwen2_tied_bias": ("Qwen2Config", 2, dict(tie_word_embeddings=True)),
    # head_dim 32 with 4 heads: q/o projections are 128 wide against hidden 64
    "qwen3_untied_qknorm": ("Qwen3Config", 2, dict(tie_word_embeddings=False, head_dim=32)),
}


@dataclass
class HFReference:
    name: str
    prompt_len: int
    hf_config: dict               # model.config.to_dict()
    tensors: dict                 # HF-named numpy float32 tensors
    tokens: np.ndarray            # [SEQ_LEN] prompt + HF greedy continuation
    logits_fp32: np.ndarray       # [SEQ_LEN, V] HF fp32 logits over `tokens`
    logits_bf16: np.ndarray       # [SEQ_LEN, V] HF bf16 model's logits, as float32


def _build(name: str) -> HFReference:
    import torch
    import transformers

    cls_name, seed, overrides = ARCHITECTURES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, cls_name)(**_COMMON, **overrides)
    model = {"LlamaConfig": transformers.LlamaForCausalLM,
             "MistralConfig": transformers.MistralForCausalLM,
             "Qwen2Config": transformers.Qwen2ForCausalLM,
             "Qwen3Config": transformers.Qwen3ForCausalLM}[cls_name](config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT_LEN))
    with torch.no_grad():
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False)
        logits_fp32 = model(tokens).logits[0].numpy()
        tensors = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        logits_bf16 = model.to(torch.bfloat16)(tokens).logits[0].float().numpy()
    return HFReference(name, PROMPT_LEN, model.config.to_dict(), tensors, tokens[0].numpy(),
                       logits_fp32, logits_bf16)


@pytest.fixture(scope="session", params=sorted(ARCHITECTURES))
def hf_reference(request) -> HFReference:
    """One tiny HF model per architecture and its reference outputs (built once per session)."""
    return _build(request.param)
