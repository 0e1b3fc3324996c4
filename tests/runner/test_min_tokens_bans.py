"""min_tokens holds back every EOS and stop id until it is reached: none is dropped (the sampler
used to keep only the first 8), and a request that would need more than the sampler holds is
refused at the door with the numbers."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.input_processor import InputProcessor
from jaxserve.runner.sampler import sample, sampling_arrays
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.limits import RequestLimits
from jaxserve.sched.sampling import MAX_BANNED_IDS, SamplingOptions

VOCAB = 128
STOP_IDS = tuple(range(40, 60))  # 20 stop ids


def greedy_pick(banned, outputs_so_far, min_tokens=5):
    logits = np.zeros((2, VOCAB), np.float32)
    for rank, t in enumerate(reversed(STOP_IDS)):
        logits[:, t] = 10.0 + rank        # every stop id beats every other token; the last one most
    logits[:, 7] = 5.0                    # the best token that is not held back
    opts = SamplingOptions(min_tokens=min_tokens, banned_before_min_tokens=banned)
    arrays = sampling_arrays([(opts, outputs_so_far), None], 2)
    return int(np.asarray(sample(jnp.asarray(logits), arrays, pad_to=2)["tokens"])[0])


def test_all_twenty_stop_ids_are_held_back_before_min_tokens():
    assert greedy_pick(STOP_IDS, outputs_so_far=0) == 7
    assert greedy_pick(STOP_IDS[:8], outputs_so_far=0) == STOP_IDS[8]  # what the 8-id cut let through
    assert greedy_pick(STOP_IDS, outputs_so_far=5) == STOP_IDS[0]      # min_tokens reached: free again


def door(**kw):
    return InputProcessor(tokenizer=None, vocab_size=VOCAB, limits=RequestLimits(64, 4, 32),
                          eos_token_ids=frozenset({2}))


def test_the_door_refuses_more_held_back_ids_than_the_sampler_holds_and_says_so():
    many = tuple(range(3, 3 + MAX_BANNED_IDS))  # with EOS: one too many
    with pytest.raises(ValueError, match=rf"must hold back {MAX_BANNED_IDS + 1} ids .* at most {MAX_BANNED_IDS}"):
        door().process({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=many))
    # without min_tokens nothing is held back, so any number of stop ids is fine
    door().process({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=8, stop_token_ids=many))
    # ignore_eos frees EOS's place
    door().process({"prompt_token_ids": [5, 6]},
                   SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=many, ignore_eos=True))


@pytest.mark.parametrize("prompt_len,params,match", [
    (64, SamplingParams(max_tokens=1), "at most 63 prompt tokens"),
    (60, SamplingParams(max_tokens=5), r"plus max_tokens \(5\) is 65 tokens, beyond max_model_len=64"),
    (10, SamplingParams(max_tokens=None, min_tokens=60), r"min_tokens=60 must be an integer in \[0, max_tokens=54\]"),
])
def test_every_length_limit_is_checked_once_at_the_door_with_the_numbers(prompt_len, params, match):
    with pytest.raises(ValueError, match=match):
        door().process({"prompt_token_ids": [5] * prompt_len}, params)


def test_the_kv_fit_check_uses_the_schedulers_formula():
    small = InputProcessor(tokenizer=None, vocab_size=VOCAB, limits=RequestLimits(256, 4, 8),
                           eos_token_ids=frozenset({2}))
    # 30 + 3 - 1 = 32 slots: exactly the 8 blocks of 4 (the last sampled token's K/V is never computed)
    small.process({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="needs 9 KV blocks of 4 tokens, but the whole KV pool has 8"):
        small.process({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=4))


def test_a_prompt_too_long_to_run_is_refused_before_its_ids_are_scanned(monkeypatch):
    scanned = []
    monkeypatch.setattr(InputProcessor, "_check_ids", lambda self, what, ids: scanned.append(what))
    with pytest.raises(ValueError, match="prompt has 100 tokens"):
        door().process({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=1))
    assert scanned == []
    door().process({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=1))
    assert scanned == ["prompt token id(s)"]
