"""Flag translation to engine arguments, and the text summary's layout."""

import argparse

import pytest

from jaxserve.bench.args import add_common, engine_kwargs, parse_rates
from jaxserve.bench.metrics import RequestRecord, summarize
from jaxserve.bench.results import run_to_json
from jaxserve.bench.backend_base import BackendRun
from jaxserve.bench.summary import format_run


def parse(*argv):
    p = argparse.ArgumentParser()
    add_common(p, "jaxserve")
    return p.parse_args(list(argv))


def test_only_engine_flags_that_are_set_reach_the_engine():
    assert engine_kwargs(parse()) == {"dtype": "float32"}
    kw = engine_kwargs(parse("--max-num-seqs", "8", "--no-enable-prefix-caching", "--engine-arg", "decode_buckets=(1, 4)",
                             "--engine-arg", "attention_impl=xla"))
    assert kw == {"dtype": "float32", "max_num_seqs": 8, "enable_prefix_caching": False,
                  "decode_buckets": (1, 4), "attention_impl": "xla"}


def test_a_malformed_engine_arg_is_rejected():
    with pytest.raises(ValueError, match="KEY=VALUE"):
        engine_kwargs(parse("--engine-arg", "nonsense"))


def test_rates_parse_as_a_list_with_inf():
    assert parse_rates("0.5, 2,inf") == [0.5, 2.0, float("inf")]
    with pytest.raises(ValueError, match="request rate"):
        parse_rates("0")


def test_summary_prints_milliseconds_and_na_for_missing_samples():
    recs = [RequestRecord("a", 4, 1, 0.0, 0.25, 0.25, token_times=(0.25,))]
    run = BackendRun("hf", "hf[batch=1]", recs, 0.5, "sha256:x")
    text = format_run(run_to_json(run))
    lines = {ln.split(":")[0]: ln.split()[-1] for ln in text.splitlines() if ":" in ln}
    assert lines["Mean TTFT (ms)"] == "250.00"
    assert lines["Mean TPOT (ms)"] == "n/a"          # one token: no TPOT samples
    assert lines["Output token throughput (tok/s)"] == "2.00"
    assert summarize(recs, 0.5).output_throughput == 2.0


@pytest.mark.parametrize("values, log", [
    ([96.9, 146.0, 178.0, 838.8], False),        # within 30x: a linear axis shows every bar
    ([96.9, 146.0, 37902.3], True),               # 390x: the small bars vanish on a linear axis
    ([None, 5.0, 400.0], True),                   # missing values are left out, not read as 0
    ([0.0, 5.0, 400.0], False),                   # a zero has no place on a log axis
    ([None], False),
])
def test_bar_charts_switch_to_a_log_axis_when_values_span_more_than_30x(values, log):
    from jaxserve.bench.plots import wants_log_scale

    assert wants_log_scale(values) is log
