"""Random PEFT LoRA adapters of a tiny HF model, and HF + peft's greedy output under one.

peft initializes lora_B to zeros (an adapter that changes nothing); these draw it at random too,
so a test comparing outputs with and without the adapter can fail. Needs torch and peft (the
`torch` extra); nothing touches a model hub.
"""

from __future__ import annotations

import os


def make_peft_adapter(base_path: str, out_path: str | os.PathLike, *, r: int, alpha: float,
                      target_modules: tuple[str, ...], use_rslora: bool = False, seed: int = 0,
                      init_scale: float = 0.3) -> str:
    """Save a random LoRA adapter of the HF model at `base_path` with `save_pretrained`."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, init_scale)
    os.makedirs(out_path, exist_ok=True)
    model.save_pretrained(str(out_path), safe_serialization=True)
    return str(out_path)


def hf_peft_greedy(base_path: str, adapter_path: str | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF transformers (fp32) with the adapter applied (None: the base
    model); EOS banned until max_new_tokens, like SamplingParams(min_tokens=max_tokens)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    if adapter_path is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_path).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
