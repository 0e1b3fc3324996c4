"""`jaxserve router` refuses bad flags with a message that names them, before it starts anything."""

import pytest

from jaxserve.cli import main


@pytest.mark.parametrize("argv, message", [
    (["router"], "no replicas"),
    (["router", "--replica", "foo"], "--replica 'foo' must be HOST:PORT"),
    (["router", "--replica", "127.0.0.1:99999"], "must be HOST:PORT with a port in [1, 65535]"),
    (["router", "--replica", "a:1", "--replica", "a:1"], "a replica is given twice"),
    (["router", "--replicas", "2", "--replica-cpus", "x"], "--replica-cpus 'x'"),
    (["router", "--replicas", "2", "--replica-cpus", "0", "--replica-cpus", "1", "--replica-cpus", "0"],
     "--replica-cpus was given 3 times for 2 replicas"),
    (["router", "--replica", "a:1", "--engine-arg=--max-num-seqs=8"], "give --replicas N"),
    (["router", "--replica", "a:1", "--balance-rel", "0.5"], "balance_rel=0.5 must be >= 1"),
    (["router", "--replica", "a:1", "--replica-devices", "0"], "give --replicas N"),
    (["router", "--replicas", "3", "--replica-devices", "0", "--replica-devices", "1"],
     "--replica-devices was given 2 times for 3 replicas"),
    (["router", "--replicas", "-1"], "--replicas -1 must be >= 0"),
    (["router", "--replica", "a:1", "--prefill-timeout-s", "-1"], "--prefill-timeout-s -1.0 must be >= 0"),
    (["router", "--replica", "a:1", "--policy", "kv_events"], "give --replica-kv-events once per replica (1), got 0"),
    (["router", "--replica", "a:1", "--replica-kv-events", "tcp://a:1"], "read by --policy kv_events only"),
    (["router", "--replica", "a:1", "--policy", "kv_events", "--replica-kv-events", "a:1"],
     "--replica-kv-events 'a:1' must be ENDPOINT"),
    (["router", "--replica", "a:1", "--policy", "kv_events", "--replica-kv-events", "tcp://a:1",
      "--kv-events-routed-s", "0"], "--kv-events-routed-s 0.0 must be > 0"),
])
def test_bad_flags_are_refused_with_their_names(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_flag_once_is_for_every_replica_or_once_per_replica():
    from jaxserve.router.children import per_replica

    assert per_replica([], 2, "--x") == [None, None]
    assert per_replica(["0"], 3, "--x") == ["0", "0", "0"]
    assert per_replica(["0", "1"], 2, "--x") == ["0", "1"]


def test_cpu_sets_parse():
    from jaxserve.router.children import parse_cpus

    assert parse_cpus("0") == {0}
    assert parse_cpus("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(ValueError, match="names no CPU|must be CPU ids"):
        parse_cpus("")


def test_local_replicas_get_kv_event_endpoints_of_their_own_that_serve_accepts():
    from jaxserve.engine_args import engine_config
    from jaxserve.router.cli import kv_events_flag, local_kv_events

    sources = local_kv_events(2)
    assert len({s.endpoint for s in sources} | {s.replay_endpoint for s in sources}) == 4
    flag, value = kv_events_flag(sources[1])
    assert flag == "--kv-events-config"
    config = engine_config(kv_events_config=value).kv_events_config
    assert config.endpoint == sources[1].endpoint and config.replay_endpoint == sources[1].replay_endpoint
    assert config.endpoint.startswith("ipc://")     # bound by the replica, local to this host
