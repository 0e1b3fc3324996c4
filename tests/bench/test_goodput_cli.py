"""`jaxserve bench serve`'s goodput flags: malformed input is a usage error naming the flag and the
expected form, and engine variants parse as documented."""

import pytest

from jaxserve.bench import cli
from jaxserve.bench.engine_variants import EngineVariant, check_unique


@pytest.mark.parametrize("argv, says", [
    (["--slo", "ttft=2"], "argument --slo: bad SLO 'ttft=2': expected ttft=SECONDS,tpot=MILLISECONDS"),
    (["--slo", "ttft=2s,tpot=300ms"], "'2s' is not a number"),
    (["--slo", "latency=2"], "argument --slo"),
    (["--request-rate", "search:4:1"], "argument --request-rate: bad request rate 'search:4:1'"),
    (["--request-rate", "1,fast"], "argument --request-rate: bad request rate '1,fast'"),
    (["--attainment", "90"], "argument --attainment: --attainment must be in (0, 1]"),
    (["--search-probes", "1"], "argument --search-probes: --search-probes must be >= 2"),
    (["--engine-variant", "t64:long_prefill_token_threshold"], "argument --engine-variant: bad engine variant"),
    (["--engine-variant", "t64:no_such_knob=1"], "'no_such_knob' is not an engine argument"),
    (["--engine-variant", "bad name:max_num_seqs=4"], "expected NAME or NAME:KEY=VALUE"),
    (["--workload", "soak"], "argument --workload: invalid choice"),
])
def test_malformed_goodput_flags_are_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "usage:" in err


def test_a_search_without_an_slo_and_repeated_variant_names_are_refused(capsys):
    with pytest.raises(SystemExit, match="needs --slo"):
        cli.main(["bench", "serve", "--request-rate", "search:0.5:4"])
    with pytest.raises(SystemExit, match="unique, repeated: \\['a'\\]"):
        cli.main(["bench", "serve", "--engine-variant", "a", "--engine-variant", "a:max_num_seqs=4"])
    with pytest.raises(SystemExit, match="--long-share"):
        cli.main(["bench", "serve", "--in-process", "--workload", "interference", "--long-share", "1"])


def test_engine_variants_parse_names_literals_and_tuples():
    assert EngineVariant.parse("default") == EngineVariant("default", {})
    v = EngineVariant.parse("mix:long_prefill_token_threshold=64, decode_buckets=(1,4,16),scheduling_policy=priority,"
                            "itl_budget_ms=None")
    assert v.name == "mix"
    assert dict(v.overrides) == {"long_prefill_token_threshold": 64, "decode_buckets": (1, 4, 16),
                                 "scheduling_policy": "priority", "itl_budget_ms": None}
    assert str(EngineVariant.parse("t0:long_prefill_token_threshold=0")) == "t0:long_prefill_token_threshold=0"
    for bad in ("", ":max_num_seqs=4", "a:", "a:max_num_seqs=4,max_num_seqs=8", "a:=4"):
        with pytest.raises(ValueError, match="bad engine variant"):
            EngineVariant.parse(bad)
    check_unique([EngineVariant("a"), EngineVariant("b")])
