"""Llama 3.1-style rope scaling, stored by llama.cpp as per-frequency divisors, read back as a config."""

import numpy as np
import pytest
from ckpt_testkit import tiny_config, tiny_tensors, write_gguf
from gguf import GGMLQuantizationType as Q

from jaxserve.checkpoints import UnsupportedArchitectureError, load_checkpoint
from jaxserve.checkpoints.rope_freqs import fit_llama3_scaling, llama3_divisors

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def llamacpp_rope_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf loop for llama3 rope factors, written from its definition."""
    factors = []
    orig, low, high = (scaling["original_max_position_embeddings"], scaling["low_freq_factor"],
                       scaling["high_freq_factor"])
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            factors.append(1.0)
        elif wavelen > orig / low:
            factors.append(scaling["factor"])
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def test_divisors_match_llamacpp_converter():
    np.testing.assert_allclose(llama3_divisors(LLAMA31, 500000.0, 128),
                               llamacpp_rope_factors(LLAMA31, 500000.0, 128), rtol=1e-6)


@pytest.mark.parametrize("scaling,theta,head_dim", [
    (LLAMA31, 500000.0, 128),                                                    # Llama 3.1 8B
    (LLAMA31 | {"factor": 32.0}, 500000.0, 64),                                  # Llama 3.2 1B
    (LLAMA31 | {"low_freq_factor": 2.0, "high_freq_factor": 8.0}, 500000.0, 128),
    (LLAMA31 | {"factor": 4.0}, 10000.0, 16),                                    # one smoothed frequency only
])
def test_fitted_scaling_reproduces_every_stored_divisor(scaling, theta, head_dim):
    stored = llamacpp_rope_factors(scaling, theta, head_dim)
    fitted = fit_llama3_scaling(stored, theta, head_dim)
    assert fitted["rope_type"] == "llama3" and fitted["factor"] == scaling["factor"]
    np.testing.assert_allclose(llama3_divisors(fitted, theta, head_dim), stored, rtol=1e-4)


def test_all_ones_is_no_scaling():
    assert fit_llama3_scaling(np.ones(8, np.float32), 10000.0, 16) is None


def test_divisors_no_llama3_scaling_explains_are_refused():
    stored = llamacpp_rope_factors(LLAMA31, 500000.0, 128)
    stored[-1] = 3.0  # the longest wavelength should carry the full factor
    with pytest.raises(ValueError, match="llama3"):
        fit_llama3_scaling(stored, 500000.0, 128)


def test_a_gguf_with_rope_freqs_loads_with_llama3_scaling(tmp_path):
    from jaxserve.models.config import ModelConfig

    config = tiny_config("llama", rope_theta=500000.0, head_dim=32, num_attention_heads=2,
                         num_key_value_heads=1)
    factors = llamacpp_rope_factors(LLAMA31, 500000.0, 32)
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tiny_tensors(config),
                      raw={"rope_freqs.weight": (factors, Q.F32)})
    ckpt = load_checkpoint(path)
    assert set(ckpt.tensors) == set(tiny_tensors(config))  # rope_freqs went into the config
    scaling = ModelConfig.from_hf_config(ckpt.config).rope_scaling
    np.testing.assert_allclose(
        llama3_divisors({"factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                         "high_freq_factor": scaling.high_freq_factor,
                         "original_max_position_embeddings": scaling.original_max_position_embeddings},
                        500000.0, 32), factors, rtol=1e-4)


def test_a_gguf_with_unexplainable_rope_freqs_is_refused(tmp_path):
    config = tiny_config("llama")
    factors = np.linspace(1, 3, config["head_dim"] // 2).astype(np.float32)[::-1].copy()
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tiny_tensors(config), tokenizer=False,
                      raw={"rope_freqs.weight": (factors, Q.F32)})
    with pytest.raises(UnsupportedArchitectureError, match="rope"):
        load_checkpoint(path)
