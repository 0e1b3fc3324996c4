"""The dispatcher: platform defaults, the forced override, and fallbacks for what a kernel declines."""

import types

import jax.numpy as jnp
import pytest

from pallas_kernel_cases import assert_matches_reference, case, make_inputs
from pallas_kernels import dispatch, ragged_paged_attention, ragged_paged_attention_reference


def fake_device(platform, compute_capability=None, kind=""):
    return types.SimpleNamespace(platform=platform, compute_capability=compute_capability, device_kind=kind)


def test_platform_defaults_are_triton_on_every_gpu_xla_on_cpu():
    # Mosaic failed the kernel check on an H200 (docs/kernels.md): forced only
    assert dispatch.default_implementation(fake_device("gpu", "9.0", "NVIDIA H200")) == "triton"
    assert dispatch.default_implementation(fake_device("gpu", "10.0", "NVIDIA B200")) == "triton"
    assert dispatch.default_implementation(fake_device("gpu", "8.0", "NVIDIA A100")) == "triton"
    assert dispatch.default_implementation(fake_device("cpu")) == "xla"
    assert dispatch.default_implementation() == "xla"          # this machine


def test_environment_variable_forces_and_argument_wins(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "triton_interpret")
    assert dispatch.resolve_implementation() == "triton_interpret"
    assert dispatch.resolve_implementation("reference") == "reference"
    monkeypatch.delenv(dispatch.ENV_VAR)
    assert dispatch.resolve_implementation() == "xla"


def test_unknown_implementation_names_the_value(monkeypatch):
    with pytest.raises(ValueError, match="'cuda'"):
        dispatch.resolve_implementation("cuda")
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="JAXSERVE_ATTENTION_IMPL='fast'"):
        dispatch.resolve_implementation()


@pytest.mark.parametrize("name, dtype, block_size, want", [
    ("mosaic", "bfloat16", 16, "mosaic"),
    ("mosaic_interpret", "float16", 16, "mosaic_interpret"),
    ("mosaic", "float32", 16, "triton"),                       # wgmma has no float32 P V
    ("mosaic_interpret", "float32", 16, "triton_interpret"),   # stays interpreted
    ("triton", "bfloat16", 8, "xla"),                          # Triton dots need >= 16 rows
    ("mosaic", "bfloat16", 24, "xla"),                         # neither kernel tiles 24
    ("reference", "bfloat16", 16, "reference"),
])
def test_declined_shapes_fall_back_mosaic_then_triton_then_xla(monkeypatch, name, dtype, block_size, want):
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")   # as on a GPU machine
    q = jnp.zeros((4, 4, 64), dtype)
    k_cache = jnp.zeros((8, block_size, 2, 64), dtype)
    used, _, _ = dispatch.choose(name, q, k_cache)
    assert used == want


@pytest.mark.parametrize("forced", ["reference", "xla", "triton_interpret"])
def test_forced_implementations_give_the_reference_result(monkeypatch, forced):
    # The Triton interpreter suite's case: the compiled interpreter is reused, not rebuilt.
    c = case("mixed", group=4, head_dim=64, dtype="float16", sliding_window=20, seed=2)
    inputs = make_inputs(c)
    want = ragged_paged_attention_reference(**inputs)
    monkeypatch.setenv(dispatch.ENV_VAR, forced)
    assert_matches_reference(ragged_paged_attention(**inputs), want, c)


@pytest.mark.parametrize("name", ["mosaic", "triton"])
def test_compiled_gpu_kernels_forced_on_the_cpu_point_to_the_interpreter(name):
    q, k_cache = jnp.zeros((4, 4, 64), jnp.bfloat16), jnp.zeros((8, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"'{name}_interpret'"):
        dispatch.choose(name, q, k_cache)
