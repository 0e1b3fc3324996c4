"""Quantized weights and a quantized KV cache split over 4 CPU devices (a child process:
cpu_devices.py): int8 projections (row-parallel ones with per-channel scales kept whole) and an
int8 KV arena whose per-KV-head scales are replicated with their heads (2 KV heads, 4 devices)
generate exactly what one device does; an int4 model whose o/down projections have 2
quantization groups along the input is refused at 4 devices with the reason."""

import pytest

from jaxserve.testing.tiny_models import make_tiny_model
from tests.parallel.cpu_devices import run_probe


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tp-quant"), "llama", seed=3, num_heads=8, num_kv_heads=2)
    return run_probe(4, "quantized", path, "4")


def test_int8_weights_and_int8_kv_cache_generate_as_on_one_device(report):
    one, four = report["1"], report["4"]
    assert four["tokens"] == one["tokens"]
    assert one["kv_dtype"] == four["kv_dtype"] == "int8"
    assert four["kv_scales_shape"] == [2, 4]            # [layers, KV heads after replication]
    assert one["kv_scales_shape"] == [2, 2]
    whole = one["qweight_per_device"][-1]
    assert four["qweight_per_device"] == [whole // 4] * 4  # down_proj's rows split four ways


def test_int4_groups_that_do_not_split_are_refused_with_the_reason(report):
    assert "does not divide" in report["int4_error"] and "quantization groups" in report["int4_error"]
