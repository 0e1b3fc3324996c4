"""w8a8 with quantize_lm_head: the LM head becomes an int8 weight in w8a8's form (tied or not),
its logits stay close to the float head's, and what it does not support is refused."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoints import load_checkpoint
from jaxserve.engine_args import engine_config
from jaxserve.models import ModelConfig, registry
from jaxserve.models.params import params_from_hf
from jaxserve.quant.prepare import QuantRequest, prepare
from jaxserve.quant.spec import QuantSpec
from jaxserve.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("head"), "llama", seed=3, tie_word_embeddings=request.param)


def _params(path: str, lm_head: bool):
    ckpt = load_checkpoint(path)
    config = ModelConfig.from_hf_config(ckpt.config)
    prepared = prepare(ckpt, QuantRequest("w8a8", lm_head=lm_head), config, jnp.float32)
    return config, prepared.checkpoint, params_from_hf(config, prepared.checkpoint.tensors, jnp.float32)


def test_the_head_is_int8_and_its_logits_stay_close_to_the_float_heads(tiny_dir):
    config, float_head_ckpt, float_head = _params(tiny_dir, lm_head=False)
    _, ckpt, quantized = _params(tiny_dir, lm_head=True)
    head = quantized["lm_head"]
    assert head["qweight"].dtype == jnp.int8
    assert head["qweight"].shape == (config.vocab_size, config.hidden_size)
    assert head["scale"].shape == (1, config.vocab_size) and head["act_smooth"].shape == (config.hidden_size,)
    # the lookup keeps its float table; a tied model has no float head of its own
    np.testing.assert_array_equal(quantized["embed_tokens"]["embedding"], float_head["embed_tokens"]["embedding"])
    assert ckpt.identity != float_head_ckpt.identity       # never served from the other's caches

    model = registry.for_config(config).model()
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((5, config.hidden_size)), jnp.float32)
    want = np.asarray(model.compute_logits(float_head, config, hidden))
    got = np.asarray(model.compute_logits(quantized, config, hidden))
    assert got.dtype == np.float32 and got.shape == want.shape
    assert not np.array_equal(got, want)                    # the int8 head is what ran
    err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert err.max() < 0.05, err                           # two int8 roundings: a few percent at most
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.8


def test_an_already_quantized_checkpoint_without_its_head_is_refused(tiny_dir):
    from jaxserve.quant.checkpoint import quantize_checkpoint

    _, quantized, _ = _params(tiny_dir, lm_head=False)       # projections in w8a8, head float
    with pytest.raises(ValueError, match="without its LM head"):
        quantize_checkpoint(quantized, QuantSpec("w8a8", lm_head=True))


def test_what_the_option_does_not_cover_is_refused():
    with pytest.raises(ValueError, match="needs quantization in"):
        QuantSpec("int8", lm_head=True)
    with pytest.raises(ValueError, match="needs quantization in"):
        engine_config(quantize_lm_head=True)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_config(quantization="w8a8", quantize_lm_head=True, tensor_parallel_size=2)
    assert "lm_head" not in QuantSpec("w8a8").describe()    # identities from before the option hold
