"""Workloads and arrival times are reproducible and have the documented shapes."""

import itertools
import json

import numpy as np
import pytest

from jaxserve.bench.arrivals import arrival_offsets
from jaxserve.bench.corpus import PARAGRAPHS
from jaxserve.bench.workloads import (
    EDIT_INSTRUCTION, BenchRequest, LengthRange, TokenSource, Workload, edit_workload, interference_workload, random_workload,
    shared_prefix_workload, sharegpt_workload, warmup_requests, with_arrivals, with_temperature,
)


def is_window_of(tokens: np.ndarray, prompt: tuple[int, ...]) -> bool:
    doubled = np.concatenate([tokens, tokens])  # windows wrap around the end of the corpus
    n = len(prompt)
    starts = np.flatnonzero(tokens == prompt[0])
    return any(tuple(doubled[s:s + n]) == prompt for s in starts)


def test_random_workload_is_reproducible_and_lengths_stay_in_range(tiny_tokenizer):
    a = random_workload(tiny_tokenizer, 12, LengthRange(5, 40), LengthRange(2, 9), seed=3)
    b = random_workload(tiny_tokenizer, 12, LengthRange(5, 40), LengthRange(2, 9), seed=3)
    c = random_workload(tiny_tokenizer, 12, LengthRange(5, 40), LengthRange(2, 9), seed=4)
    assert a == b and a != c
    assert all(5 <= len(r.prompt_token_ids) <= 40 and 2 <= r.output_len <= 9 for r in a.requests)
    assert len({r.request_id for r in a.requests}) == 12


def test_random_prompts_are_windows_of_real_text(tiny_tokenizer):
    src = TokenSource(tiny_tokenizer)
    w = random_workload(tiny_tokenizer, 5, LengthRange(20, 30), LengthRange(1, 1), seed=0)
    assert all(is_window_of(src.tokens, r.prompt_token_ids) for r in w.requests)
    text = tiny_tokenizer.decode(list(w.requests[0].prompt_token_ids))
    assert sum(c.isalpha() for c in text) > 0.6 * len(text)


@pytest.mark.parametrize("text, ratio, want", [("32:512", 0.0, (32, 512)), ("100", 0.0, (100, 100)),
                                               ("100", 0.5, (50, 150))])
def test_length_ranges_parse_like_vllm(text, ratio, want):
    r = LengthRange.parse(text, ratio)
    assert (r.low, r.high) == want


@pytest.mark.parametrize("text", ["0:4", "9:3"])
def test_bad_length_ranges_are_rejected(text):
    with pytest.raises(ValueError, match="length range"):
        LengthRange.parse(text)


def test_shared_prefix_groups_share_exactly_their_system_prompt(tiny_tokenizer):
    w = shared_prefix_workload(tiny_tokenizer, num_groups=3, prompts_per_group=4, system_prompt_len=24,
                               question_len=6, output_len=5, seed=1)
    assert len(w.requests) == 12
    by_group = {}
    for r in w.requests:
        assert len(r.prompt_token_ids) == 30 and r.output_len == 5
        by_group.setdefault(r.group, []).append(r.prompt_token_ids)
    systems = {g: {p[:24] for p in ps} for g, ps in by_group.items()}
    assert all(len(s) == 1 for s in systems.values())                    # one system prompt per group
    assert len({next(iter(s)) for s in systems.values()}) == 3           # and different across groups
    assert [r.group for r in w.requests] != sorted(r.group for r in w.requests)  # shuffled together
    assert w == shared_prefix_workload(tiny_tokenizer, 3, 4, 24, 6, 5, seed=1)


def test_sharegpt_takes_first_turns_and_drops_unusable_pairs(tiny_tokenizer, tmp_path):
    long_reply = "The river crossed the village square before the sun went down. " * 3
    data = [
        {"conversations": [{"from": "human", "value": "Tell me how the old mill worked in the valley."},
                           {"from": "gpt", "value": long_reply}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": long_reply}]},  # too short
        {"conversations": [{"from": "human", "value": "Only one turn here, nothing else at all."}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    w = sharegpt_workload(tiny_tokenizer, path, num_prompts=1, seed=0)
    (r,) = w.requests
    assert r.output_len == len(tiny_tokenizer.encode(long_reply, add_special_tokens=False))
    assert list(r.prompt_token_ids) == tiny_tokenizer.encode(data[0]["conversations"][0]["value"],
                                                             add_special_tokens=False)
    with pytest.raises(ValueError, match="only 1 usable"):
        sharegpt_workload(tiny_tokenizer, path, num_prompts=2)


def test_interference_long_prompts_wait_for_the_chats(tiny_tokenizer):
    w = interference_workload(tiny_tokenizer, num_chats=3, chat_prompt_len=8, chat_output_len=5, num_long=2,
                              long_prompt_len=50, long_output_len=2, long_interval=0.25, seed=0)
    chats = [r for r in w.requests if r.group == "chat"]
    longs = [r for r in w.requests if r.group == "long"]
    assert len(chats) == 3 and all(r.after_group is None and r.arrival_offset == 0 for r in chats)
    assert [r.arrival_offset for r in longs] == [0.0, 0.25]
    assert all(r.after_group == "chat" and len(r.prompt_token_ids) == 50 for r in longs)
    with pytest.raises(ValueError, match="sets its own arrival"):
        with_arrivals(w, 2.0)


def test_warmup_requests_do_not_share_a_prefix_with_the_timed_ones(tiny_tokenizer):
    w = random_workload(tiny_tokenizer, 4, LengthRange(20, 20), LengthRange(3, 3), seed=0)
    warm = warmup_requests(w, 2)
    assert [len(r.prompt_token_ids) for r in warm] == [20, 20]
    assert all(r.prompt_token_ids[:4] != q.prompt_token_ids[:4] for r, q in zip(warm, w.requests))


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, float("inf")) == [0.0] * 5


def test_poisson_gaps_have_the_requested_mean_and_are_reproducible():
    t = np.asarray(arrival_offsets(20001, 4.0, seed=7))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(1.0, rel=0.05)   # exponential: CV^2 = 1
    assert arrival_offsets(50, 4.0, seed=7) == arrival_offsets(50, 4.0, seed=7)


def test_burstiness_changes_the_spread_not_the_mean():
    gaps = np.diff(arrival_offsets(20001, 4.0, burstiness=0.25, seed=1))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert (gaps.std() / gaps.mean()) ** 2 == pytest.approx(4.0, rel=0.15)   # gamma: CV^2 = 1 / shape


@pytest.mark.parametrize("rate, burst", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_rates_are_rejected(rate, burst):
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burst)


def test_edit_workload_asks_to_rewrite_real_text_with_typos_and_expects_its_length(tiny_tokenizer):
    a = edit_workload(tiny_tokenizer, 4, seed=1)
    assert a == edit_workload(tiny_tokenizer, 4, seed=1) and a != edit_workload(tiny_tokenizer, 4, seed=2)
    for r in a.requests:
        prompt = tiny_tokenizer.decode(list(r.prompt_token_ids))
        assert EDIT_INSTRUCTION.strip() in prompt
        body = prompt.split(EDIT_INSTRUCTION.strip(), 1)[1]
        # every paragraph's words are in the prompt, some of them with two letters swapped
        used = [p for p in PARAGRAPHS if p.split()[0] in body and p.split()[-1] in body]
        assert used and sum(w not in body for p in used for w in p.split()) > 0
        lengths = {len(tiny_tokenizer.encode("\n\n".join(pair), add_special_tokens=False))
                   for pair in itertools.permutations(used, 2)}
        assert r.output_len in lengths          # the corrected text is as long as the original
    fixed = edit_workload(tiny_tokenizer, 2, LengthRange(7, 7), seed=1)
    assert [r.output_len for r in fixed.requests] == [7, 7]


def test_with_temperature_samples_the_same_requests():
    w = Workload("w", (BenchRequest("a", (1, 2), 3),), {})
    assert with_temperature(w, 0.0) is w
    hot = with_temperature(w, 0.8)
    assert hot.requests[0].temperature == 0.8 and hot.requests[0].prompt_token_ids == (1, 2)
    with pytest.raises(ValueError):
        with_temperature(w, -1.0)
