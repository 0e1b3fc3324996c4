"""A tiny random Qwen3 checkpoint whose tokenizer and chat template do what the tool-calling and
reasoning tests need: `<think>`, `</think>`, `<tool_call>` and `</tool_call>` are tokens of its
vocabulary (not special, as in Qwen's), and its template (written here, Hermes-style) renders the
tools, an assistant's earlier calls and reasoning, tool results, and opens `<think>` in the
generation prompt unless enable_thinking is false."""

from __future__ import annotations

import os

TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

TEMPLATE = (
    "{%- if tools %}<|system|>Tools you may call, one <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> "
    "each:\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>"
    "{%- if m.reasoning_content is string %}<think>{{ m.reasoning_content }}</think>\n{% endif %}"
    "{{- m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": {{ c.function.name | tojson }}, "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}"
    "{%- elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id or '' }}: {{ m.content }}{{ '\\n' }}"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}{{ '\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{% endif %}{% endif %}")


def make_tiny_chat_qwen3(path: str | os.PathLike, *, seed: int = 0) -> str:
    import torch

    from jaxserve.models import registry
    from jaxserve.testing.tiny_models import make_tokenizer

    tok = make_tokenizer(320)
    tok.add_tokens(TAGS)
    tok.chat_template = TEMPLATE
    config_cls, cls = registry.transformers_classes("qwen3")
    config = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                        initializer_range=0.2, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = cls(config).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)
