"""Requests that are bad or could never run are rejected at the door, with their numbers."""

import pytest
from sched_testkit import make_request

from jaxserve.sched import Request, Scheduler, SchedulerConfig


@pytest.fixture
def sched():
    return Scheduler(SchedulerConfig(num_blocks=9, block_size=4, max_model_len=100))  # 8 usable blocks


def test_an_empty_prompt_is_rejected(sched):
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add_request(Request("a", [], 4))


def test_a_prompt_longer_than_max_model_len_is_rejected(sched):
    with pytest.raises(ValueError, match="prompt has 101 tokens, but max_model_len is 100"):
        sched.add_request(make_request("a", 101, max_tokens=1))


def test_prompt_plus_max_tokens_beyond_max_model_len_is_rejected(sched):
    with pytest.raises(ValueError, match=r"prompt \(90 tokens\) plus max_tokens \(11\) is 101 tokens, beyond max_model_len=100"):
        sched.add_request(make_request("a", 90, max_tokens=11))


def test_a_request_that_could_never_fit_the_pool_is_rejected(sched):
    # 30 + 4 - 1 = 33 slots need 9 blocks of 4; the pool has 8
    with pytest.raises(ValueError, match="needs 9 KV blocks of 4 tokens, but the whole KV pool has 8"):
        sched.add_request(make_request("a", 30, max_tokens=4))
    sched.add_request(make_request("b", 30, max_tokens=3))  # 32 slots: exactly the pool


def test_a_duplicate_request_id_is_rejected(sched):
    sched.add_request(make_request("a", 5))
    with pytest.raises(ValueError, match="'a' is already in the scheduler"):
        sched.add_request(make_request("a", 5))


def test_rejected_requests_leave_no_trace(sched):
    with pytest.raises(ValueError):
        sched.add_request(make_request("a", 101))
    assert not sched.has_unfinished_requests() and sched.stats().num_kv_blocks_free == 8


@pytest.mark.parametrize(
    "kw,field",
    [({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 9}, "min_tokens"), ({"priority": 1.5}, "priority")],
)
def test_bad_request_fields_name_the_field(kw, field):
    args = {"max_tokens": 8, **kw}
    with pytest.raises(ValueError, match=field):
        Request("a", [1, 2], args.pop("max_tokens"), **args)


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive int, got 0"),
        ({"block_size": -1}, "block_size must be a positive int, got -1"),
        ({"num_blocks": 1}, "num_blocks must be >= 2"),
        ({"long_prefill_token_threshold": -3}, "long_prefill_token_threshold must be an int >= 0, got -3"),
        ({"enable_chunked_prefill": False, "long_prefill_token_threshold": 8, "max_num_batched_tokens": 4096},
         "needs enable_chunked_prefill=True"),
        ({"enable_chunked_prefill": False, "max_model_len": 30, "max_num_batched_tokens": 30, "chunk_granularity": 8},
         "a whole prompt of 29 tokens costs 32 of the budget, so max_num_batched_tokens=30 must be >= 32"),
    ],
)
def test_bad_configs_are_rejected_with_the_field_and_value(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SchedulerConfig(**{"num_blocks": 8, **kw})
