"""`jaxserve convert --quantization`: the converted directory holds the quantized weights (fp8 with
its calibrated activation scales), loads back to the same params, and carries its own identity."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoints import load_checkpoint
from jaxserve.quant.convert import convert
from jaxserve.models.quantized_tensor import QuantizedTensor
from jaxserve.cli import main
from jaxserve.models import ModelConfig
from jaxserve.models.params import params_from_hf
from jaxserve.quant.prepare import QuantRequest, prepare


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8", "w8a8"])
def test_converted_quantized_checkpoint_loads_back_to_the_same_params(tiny_llama_dir, tmp_path, mode):
    dst = convert(tiny_llama_dir, tmp_path / mode, quantization=mode)
    src = load_checkpoint(tiny_llama_dir)
    back = load_checkpoint(dst)
    config = ModelConfig.from_hf_config(src.config)
    want = prepare(src, QuantRequest(mode), config, jnp.float32).checkpoint
    assert back.identity == want.identity != src.identity
    assert json.load(open(os.path.join(dst, "identity.json")))["quantized"] is True
    kinds = {t.mode for t in back.tensors.values() if isinstance(t, QuantizedTensor)}
    assert kinds == {mode}
    if mode == "fp8":
        assert all(t.act_scale is not None for t in back.tensors.values() if isinstance(t, QuantizedTensor))
    a = params_from_hf(config, back.tensors, jnp.float32)
    b = params_from_hf(config, want.tensors, jnp.float32)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)),
                 a, b)
    # served as it is: quantization="none" (or the same mode) keeps it, another mode is refused
    assert prepare(back, QuantRequest(mode), config, jnp.float32).checkpoint.identity == back.identity
    other = "int4" if mode != "int4" else "int8"
    with pytest.raises(ValueError, match="already quantized"):
        prepare(back, QuantRequest(other), config, jnp.float32)


def test_cli_convert_takes_the_quantization_flags(tiny_llama_dir, tmp_path):
    assert main(["convert", tiny_llama_dir, str(tmp_path / "q"), "--quantization", "int4",
                 "--quantization-group-size", "128"]) == 0
    t = load_checkpoint(tmp_path / "q").tensors["model.layers.0.mlp.down_proj.weight"]
    assert t.kind == "int4" and t.group == 128          # the MLP's 128 inputs: one group per row
