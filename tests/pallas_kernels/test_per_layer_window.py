"""Per-layer sliding windows with a soft cap, as Gemma's layers use them: the XLA implementation
and the Triton and Mosaic kernels (in their interpreters) against the reference.

Two layers share one step's block tables and lengths (random, non-contiguous pages; unowned
slots NaN: pallas_kernel_cases.make_inputs) but have their own caches and windows, one short
and one long, each a separate static call as the runner makes it per layer. The scale is twice
1/sqrt(head_dim), so scores reach the soft cap's bend; the checks first make sure the window and
the cap each change the reference's answer here, so a kernel that ignored either would fail.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernel_cases import Case, assert_matches_reference, make_inputs, reference
from pallas_kernels import dispatch
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla

WINDOWS = (8, 24)      # layer 0 (short: most of every context out of reach), layer 1
SOFT_CAP = 3.0
BLOCK = 16


def _layers(c: Case, *, uniform_q_len: int | None = None) -> list[dict]:
    """The inputs of the two layers: the same batch layout, layer 1's caches derived from layer
    0's (head_dim reversed, negated: NaN slots stay NaN) and its own window."""
    base = make_inputs(c)
    base["sm_scale"] = 2.0 / np.sqrt(c.head_dim)
    base["soft_cap"] = SOFT_CAP
    if uniform_q_len is not None:     # the runner's uniform slots: slot s owns rows [s q, (s+1) q)
        base["cu_q_lens"] = jnp.arange(c.max_seqs + 1, dtype=jnp.int32) * uniform_q_len
    second = dict(base, k_cache=-base["k_cache"][..., ::-1], v_cache=-base["v_cache"][..., ::-1])
    return [dict(base, sliding_window=WINDOWS[0]), dict(second, sliding_window=WINDOWS[1])]


def _check_options_matter(layers: list[dict]) -> None:
    # the same layer's inputs under the other window, and without the cap, give other answers
    for i, inputs in enumerate(layers):
        want = np.asarray(reference(**inputs).astype(jnp.float32))
        other = dict(inputs, sliding_window=WINDOWS[1 - i])
        uncapped = dict(inputs, soft_cap=None)
        for changed in (other, uncapped):
            assert np.abs(np.asarray(reference(**changed).astype(jnp.float32)) - want).max() > 0.05


# decodes (one row each) and uniform 4-row prefill chunks: kv_lens past both windows, one shorter
# than the long window, one of a single token
DECODE = Case(q_lens=(1, 1, 1), kv_lens=(40, 17, 64), max_seqs=4, num_tokens=4, block_size=BLOCK,
              width=4, num_blocks=16, seed=31)
PREFILL = Case(q_lens=(4, 4, 4), kv_lens=(4, 30, 64), max_seqs=4, num_tokens=16, block_size=BLOCK,
               width=4, num_blocks=16, seed=32)
# a ragged batch for the GPU kernels (decode, chunk, fresh prompt, decode of 1)
MIXED = Case(q_lens=(1, 8, 6, 1), kv_lens=(50, 32, 6, 1), num_kv_heads=1, group=4, head_dim=64,
             block_size=BLOCK, width=4, num_blocks=16, seed=33)


@pytest.mark.parametrize("c, qlen", [(DECODE, 1), (PREFILL, 4)], ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_per_layer_windows_match_reference(c, qlen, dtype):
    c = dataclasses.replace(c, dtype=dtype, group=3, head_dim=32)
    layers = _layers(c, uniform_q_len=qlen)
    _check_options_matter(layers)
    for inputs in layers:
        # kv_chunk_blocks=1: the short window skips whole chunks of the long contexts
        got = ragged_paged_attention_xla(**inputs, uniform_q_len=qlen, kv_chunk_blocks=1, items_per_iter=2)
        assert_matches_reference(got, reference(**inputs), c)


@pytest.mark.parametrize("name, dtype", [("triton_interpret", "float32"), ("mosaic_interpret", "bfloat16")])
def test_gpu_kernels_per_layer_windows_match_reference_in_interpreter(name, dtype):
    c = dataclasses.replace(MIXED, dtype=dtype)
    layers = _layers(c)
    assert dispatch.choose(name, layers[0]["q"], layers[0]["k_cache"])[0] == name   # no fallback
    _check_options_matter(layers)
    for inputs in layers:
        got = dispatch.ragged_paged_attention(**inputs, implementation=name)
        assert_matches_reference(got, reference(**inputs), c)
