"""The wire <-> engine conversions, without a server: unset proto fields keep the engine's
defaults, set ones (even to zero) are passed, limits and bad values name the field."""

import pytest

from jaxserve.client import build_request
from jaxserve.sampling_params import OutputKind, SamplingParams
from jaxserve.server.convert import prompt_from_proto, sampling_params_from_proto
from jaxserve.server.request_caps import RequestCaps
from jaxserve.proto import generation_pb2 as pb


def test_unset_fields_keep_the_engine_defaults_and_the_stream_is_delta():
    got = sampling_params_from_proto(pb.SamplingParams())
    want = SamplingParams(output_kind=OutputKind.DELTA)
    assert got == want and got.temperature == 1.0 and got.max_tokens == 16


def test_fields_set_to_zero_are_passed_not_dropped():
    got = sampling_params_from_proto(build_request("x", temperature=0.0, top_k=0, seed=0, min_tokens=0,
                                                   ignore_eos=False).sampling_params)
    assert got.temperature == 0.0 and got.seed == 0 and got.greedy


def test_every_field_round_trips_through_the_client_request():
    req = build_request("x", temperature=0.5, top_p=0.25, top_k=7, min_p=0.125, seed=3, max_tokens=9, min_tokens=2,
                        stop=["END", "\n\n"], stop_token_ids=[5, 6], ignore_eos=True, skip_special_tokens=False,
                        include_stop_str_in_output=True)
    got = sampling_params_from_proto(req.sampling_params)
    assert got == SamplingParams(temperature=0.5, top_p=0.25, top_k=7, min_p=0.125, seed=3, max_tokens=9,
                                 min_tokens=2, stop=("END", "\n\n"), stop_token_ids=(5, 6), ignore_eos=True,
                                 skip_special_tokens=False, include_stop_str_in_output=True,
                                 output_kind=OutputKind.DELTA)


@pytest.mark.parametrize("kw, field", [(dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
                                       (dict(min_p=2.0), "min_p"), (dict(max_tokens=0), "max_tokens"),
                                       (dict(n=3), "n"), (dict(max_tokens=99), "max_tokens")])
def test_bad_values_and_limits_raise_value_errors_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        sampling_params_from_proto(build_request("x", **kw).sampling_params, RequestCaps(max_n=1, max_tokens=50))


def test_prompts_of_each_kind_and_the_cache_salt():
    assert prompt_from_proto(build_request("hello", cache_salt="tenant-a")) == {"prompt": "hello",
                                                                                "cache_salt": "tenant-a"}
    assert prompt_from_proto(build_request([1, 2, 3])) == {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match="input"):
        prompt_from_proto(pb.GenerateRequest())
    chat = build_request([{"role": "user", "content": "hi"}])
    assert chat.WhichOneof("input") == "chat" and chat.chat.messages[0].content == "hi"


@pytest.mark.parametrize("kw, field, bound", [
    (dict(temperature=float("inf")), "temperature", "[0, 100]"),
    (dict(temperature=1e308), "temperature", "[0, 100]"),
    (dict(temperature=float("nan")), "temperature", "[0, 100]"),
    (dict(temperature=100.5), "temperature", "[0, 100]"),
    (dict(top_p=float("nan")), "top_p", "(0, 1]"),
    (dict(min_p=float("inf")), "min_p", "[0, 1]"),
    (dict(top_k=2**40), "top_k", str(2**31 - 1)),
    (dict(max_tokens=2**40), "max_tokens", str(2**31 - 1)),
    (dict(min_tokens=2**40, max_tokens=None), "min_tokens", str(2**31 - 1)),
    (dict(stop_token_ids=[2**40]), "stop_token_ids", str(2**31 - 1)),
    (dict(stop=["a"] * 65), "stop", "at most 64 strings"),
    (dict(stop=["x" * 1025]), "stop", "at most 1024 characters"),
])
def test_non_finite_and_absurd_sampling_values_are_refused_naming_the_field_and_the_bound(kw, field, bound):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert f"SamplingParams.{field}=" in str(e.value) and bound in str(e.value)


@pytest.mark.parametrize("temperature", [float("inf"), 1e308, float("nan")])
def test_non_finite_and_absurd_temperatures_on_the_wire_are_refused(temperature):
    with pytest.raises(ValueError, match="temperature"):
        sampling_params_from_proto(build_request("x", temperature=temperature).sampling_params)


def test_the_bounds_themselves_are_accepted():
    p = SamplingParams(temperature=100.0, top_k=2**31 - 1, max_tokens=2**31 - 1, stop_token_ids=[2**31 - 1])
    assert p.temperature == 100.0 and p.top_k == 2**31 - 1
