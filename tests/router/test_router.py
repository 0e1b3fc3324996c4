"""`jaxserve router` as real processes on loopback, in front of two real tiny-model replicas:
the same greedy answers as a replica directly; the same health, model and server info surface;
cache-aware routing's prefix hit rate above round robin's with each replica within a bounded share;
a salt never routed by another tenant's prefix; cancel, deadline and Abort reaching the replica
and freeing its blocks; a replica killed mid-workload loses no request that had not started
streaming, leaks no block on the survivor, and rejoins when a replica serves on its address again.

The replicas are gated (tests/server/step_gate.py): whatever must be in flight is held there by
the engine, never by a wall-clock window. The kill test runs last: it changes the replica set."""

import threading

import grpc
import pytest

from jaxserve.client import GenerationClient
from jaxserve.router.cli import kv_events_flag
from jaxserve.router.event_index import KVEventsSource
from tests.router.router_process import RouterProcess, generate, server_info
from tests.server import server_process
from tests.server.server_process import ServerProcess, wait_until

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir, xla_cache_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    # each publishes its KV events (for --policy kv_events) on sockets of its own
    events = {name: KVEventsSource(f"ipc://{d}/{name}.pub", f"ipc://{d}/{name}.replay") for name in "ab"}
    first = ServerProcess(tiny_llama_dir, xla_cache_dir, d / "a.log", *kv_events_flag(events["a"]), gated=True)
    first.release_warm_up()
    first.wait_serving()          # fills the compilation cache the second start then loads
    second = ServerProcess(tiny_llama_dir, xla_cache_dir, d / "b.log", *kv_events_flag(events["b"]), gated=True)
    second.release_warm_up()
    second.wait_serving()
    first.kv_events, second.kv_events = events["a"], events["b"]
    yield [first, second]
    for s in (first, second):
        s.kill()


def _router(replicas, tmp_path_factory, name, *flags):
    r = RouterProcess([s.target for s in replicas], tmp_path_factory.mktemp(name) / "router.log",
                      "--model", replicas[0].proc.args[replicas[0].proc.args.index("--model") + 1],
                      "--index-chunk-tokens", "4", *flags)
    r.wait_serving()
    return r


@pytest.fixture(scope="module")
def cache_aware(replicas, tmp_path_factory):
    r = _router(replicas, tmp_path_factory, "router-ca", "--policy", "cache_aware")
    yield r
    assert r.stop() == 0, r.log()


@pytest.fixture(scope="module")
def kv_events(replicas, tmp_path_factory):
    flags = [a for s in replicas for a in ("--replica-kv-events", f"{s.kv_events.endpoint},{s.kv_events.replay_endpoint}")]
    r = _router(replicas, tmp_path_factory, "router-ev", "--policy", "kv_events", *flags)
    yield r
    assert r.stop() == 0, r.log()


@pytest.fixture(scope="module")
def round_robin(replicas, tmp_path_factory):
    r = _router(replicas, tmp_path_factory, "router-rr", "--policy", "round_robin")
    yield r
    assert r.stop() == 0, r.log()


def assert_blocks_all_back(target):
    info = wait_until(lambda: (lambda i: i if i.num_requests_running == 0 and i.num_requests_waiting == 0 else None)(
        server_info(target)), f"no running or waiting requests on {target}")
    assert info.num_kv_blocks_free + info.num_kv_blocks_cached == info.num_kv_blocks_total
    return info


PROMPTS = ["The tide comes in", "def add(a, b):", "Unicode: café", [5, 17, 42, 99, 7, 3]]


@pytest.mark.parametrize("prompt", PROMPTS + [[{"role": "user", "content": "A paged KV cache"}]])
def test_router_answers_as_the_replica_does(cache_aware, replicas, prompt):
    direct, _ = generate(replicas[0].target, prompt, max_tokens=8, **GREEDY)
    routed, trailer = generate(cache_aware.target, prompt, max_tokens=8, **GREEDY)
    assert routed.token_ids == direct.token_ids and len(routed.token_ids) == 8
    assert routed.text == direct.text
    assert (routed.finish_reason, routed.prompt_tokens, routed.completion_tokens) == \
        (direct.finish_reason, direct.prompt_tokens, direct.completion_tokens)
    assert trailer["jaxserve-replica"] in {s.target for s in replicas}


def test_health_model_info_errors_and_server_info_look_like_an_engine(cache_aware, replicas):
    assert cache_aware.health() == "SERVING"
    with GenerationClient(cache_aware.target, timeout=30) as via, GenerationClient(replicas[0].target, timeout=30) as c:
        assert via.model_info() == c.model_info()
        with pytest.raises(grpc.RpcError) as routed:
            via.generate("x", max_tokens=2, top_p=1.5)
        with pytest.raises(grpc.RpcError) as direct:
            c.generate("x", max_tokens=2, top_p=1.5)
    assert routed.value.code() == direct.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert routed.value.details() == direct.value.details()
    info = server_info(cache_aware.target)
    assert info.state == "serving" and [r.target for r in info.replicas] == [s.target for s in replicas]
    assert all(r.health == "SERVING" for r in info.replicas)
    assert info.num_kv_blocks_total == sum(r.info.num_kv_blocks_total for r in info.replicas) > 0
    assert info.prompt_tokens_total == sum(r.info.prompt_tokens_total for r in info.replicas)


def test_api_key_and_tls_on_the_router_as_on_an_engine(replicas, tmp_path_factory):
    d = tmp_path_factory.mktemp("router-tls")
    cert, key = server_process.self_signed_cert(str(d))
    root = open(cert, "rb").read()
    r = RouterProcess([s.target for s in replicas], d / "router.log", "--policy", "round_robin",
                      "--api-key", "router-key", "--tls-cert", cert, "--tls-key", key, tls_root_cert=root)
    try:
        r.wait_serving()                     # health is open without the key
        with GenerationClient(r.target, tls_root_cert=root, timeout=60) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate([5, 6, 7], max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with GenerationClient(r.target, api_key="router-key", tls_root_cert=root, timeout=60) as c:
            assert c.generate([5, 6, 7], max_tokens=2, **GREEDY).completion_tokens == 2
    finally:
        assert r.stop() == 0, r.log()


def _shared_prefix_workload(seed_base: int):
    """4 groups x 4 prompts: a 32-token system prompt (8 blocks of 4) and an 8-token question.
    Rounds alternate the group order (0 1 2 3, then 1 0 3 2), so round robin over two replicas
    sends every group to both."""
    systems = [[(seed_base + 37 * g + 11 * i) % 250 + 20 for i in range(32)] for g in range(4)]
    order = [0, 1, 2, 3, 1, 0, 3, 2] * 2
    seen = [0] * 4
    prompts = []
    for g in order:
        seen[g] += 1
        prompts.append(systems[g] + [(seed_base + 7 * g + 13 * seen[g] + j) % 250 + 20 for j in range(8)])
    return prompts


def _run(router, salt):
    cached = total = 0
    counts: dict[str, int] = {}
    for p in _shared_prefix_workload(seed_base=3):
        done, trailer = generate(router.target, p, max_tokens=2, cache_salt=salt, **GREEDY)
        cached += done.cached_tokens
        total += done.prompt_tokens
        counts[trailer["jaxserve-replica"]] = counts.get(trailer["jaxserve-replica"], 0) + 1
    return cached / total, counts


def test_cache_aware_hits_the_prefix_cache_more_than_round_robin_within_a_bounded_share(cache_aware, round_robin):
    # each run under its own salt: neither is served by what the other left in the replicas' caches
    ca_rate, ca_counts = _run(cache_aware, "hit-rate-ca")
    rr_rate, rr_counts = _run(round_robin, "hit-rate-rr")
    assert ca_rate > rr_rate, (ca_rate, rr_rate)
    assert sorted(rr_counts.values()) == [8, 8]
    assert len(ca_counts) == 2 and max(ca_counts.values()) <= 1.5 * 16 / 2, ca_counts


def test_kv_events_routing_hits_the_cache_at_least_as_often_as_the_prefix_index(cache_aware, kv_events):
    ev_rate, ev_counts = _run(kv_events, "hit-rate-ev")
    ca_rate, _ = _run(cache_aware, "hit-rate-ca2")
    assert ev_rate >= ca_rate, (ev_rate, ca_rate)
    assert len(ev_counts) == 2 and max(ev_counts.values()) <= 1.5 * 16 / 2, ev_counts


def _indexed_tokens(router, replica_target) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("jaxserve_router_replica_indexed_tokens{") and f'replica="{replica_target}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_kv_events_routing_finds_a_prefix_cached_without_the_router(kv_events, cache_aware, replicas):
    prompt = [(11 * i) % 250 + 20 for i in range(40)]
    with GenerationClient(replicas[1].target, timeout=120) as c:     # straight to the second replica
        c.generate(prompt, max_tokens=2, cache_salt="direct", **GREEDY)
    # its events reach the router (a bounded wait on the router's own gauge, not a timing)
    wait_until(lambda: _indexed_tokens(kv_events, replicas[1].target) >= 40,
               "the router's index of the second replica holds the prompt")
    done, trailer = generate(kv_events.target, prompt, max_tokens=2, cache_salt="direct", **GREEDY)
    assert trailer["jaxserve-replica"] == replicas[1].target
    # the router knows all 10 blocks; the replica serves 9 of them (the last prompt token is computed)
    assert int(trailer["jaxserve-prefix-match"]) == 40 and done.cached_tokens == 36
    # the router's own record never saw it: cache_aware routes it by load, with no match
    _, t2 = generate(cache_aware.target, prompt + [7], max_tokens=2, cache_salt="direct", **GREEDY)
    assert int(t2["jaxserve-prefix-match"]) == 0


def test_a_salt_never_routes_by_another_tenants_prefix(cache_aware):
    prompt = [(7 * i) % 250 + 20 for i in range(40)]
    first, t1 = generate(cache_aware.target, prompt, max_tokens=2, cache_salt="tenant-1", **GREEDY)
    again, t2 = generate(cache_aware.target, prompt, max_tokens=2, cache_salt="tenant-1", **GREEDY)
    assert int(t1["jaxserve-prefix-match"]) == 0
    assert int(t2["jaxserve-prefix-match"]) == 40 and t2["jaxserve-replica"] == t1["jaxserve-replica"]
    assert again.cached_tokens > 0
    for salt in ("tenant-2", None):
        other, t3 = generate(cache_aware.target, prompt, max_tokens=2, cache_salt=salt, **GREEDY)
        assert int(t3["jaxserve-prefix-match"]) == 0
        assert other.cached_tokens == 0


def _held(replicas):
    """Both replicas' engines held still (a new request still gets its first output)."""
    import contextlib

    stack = contextlib.ExitStack()
    for s in replicas:
        stack.enter_context(s.steps_held())
    return stack


def _idle(target):
    i = server_info(target)
    return i.num_requests_running == 0 and i.num_requests_waiting == 0


def test_cancel_through_the_router_frees_the_replicas_blocks(cache_aware, replicas):
    with _held(replicas):
        with GenerationClient(cache_aware.target, timeout=120) as c:
            stream = c.stream("The tide comes in", max_tokens=60, **GREEDY)
            next(stream)                                   # streaming: it holds blocks on a replica
            assert not all(_idle(s.target) for s in replicas)
            stream.close()                                 # cancels the call at the router
        # still held: only the propagated cancel can have ended it on the replica
        for s in replicas:
            wait_until(lambda: _idle(s.target), f"{s.target} to drop the cancelled request")
    for s in replicas:
        assert_blocks_all_back(s.target)


def test_a_passed_deadline_through_the_router_frees_the_replicas_blocks(cache_aware, replicas):
    with _held(replicas):
        with pytest.raises(grpc.RpcError) as e:
            generate(cache_aware.target, "def add(a, b):", max_tokens=60, timeout=1.0, **GREEDY)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for s in replicas:
            wait_until(lambda: _idle(s.target), f"{s.target} to drop the expired request")
    for s in replicas:
        assert_blocks_all_back(s.target)


def test_abort_through_the_router_ends_the_stream_with_abort(cache_aware, replicas):
    with _held(replicas):
        with GenerationClient(cache_aware.target, timeout=120) as c:
            result = []

            def consume():
                result.append(generate(cache_aware.target, "Unicode: café", max_tokens=60,
                                       request_id="router-abort-me", **GREEDY)[0])

            t = threading.Thread(target=consume)
            t.start()
            wait_until(lambda: not all(_idle(s.target) for s in replicas), "the request to reach a replica")
            c.abort(["router-abort-me", "an-id-nobody-has"])
            t.join(120)
    assert result and result[0].finish_reason == "abort"
    for s in replicas:
        assert_blocks_all_back(s.target)


@pytest.mark.slow   # kills and restarts a replica process (~16 s); the router's other paths run by default
def test_killing_a_replica_loses_no_request_that_had_not_streamed_and_it_rejoins(
        round_robin, cache_aware, replicas, tiny_llama_dir, xla_cache_dir, tmp_path_factory):
    survivor, victim = replicas
    # 6 per replica: 4 seats stream, 2 wait silently; 100 tokens each, so none of the streaming
    # ones ends in the few steps the held engines still take to admit the others
    n = 12
    outcome: list[dict] = [dict(streamed=False) for _ in range(n)]

    def run(i):
        try:
            with GenerationClient(round_robin.target, timeout=300) as c:
                for _ in c.stream([20 + i, 30 + i, 40 + i, 50 + i], max_tokens=100, **GREEDY):
                    outcome[i]["streamed"] = True
            outcome[i]["ok"] = True
        except grpc.RpcError as e:
            outcome[i]["error"] = e.code()

    with survivor.steps_held():
        victim._gate("hold")                # never released: the victim dies held
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        wait_until(lambda: sum(o["streamed"] for o in outcome) == 8, "8 requests streaming (4 seats x 2)")
        wait_until(lambda: all(server_info(s.target).num_requests_waiting == 2 for s in replicas),
                   "2 requests waiting on each replica")
        victim.proc.kill()                  # SIGKILL: no drain, its calls break
        victim.proc.wait(30)
        try:
            victim.proc.stdin.close()
        except BrokenPipeError:
            pass
        wait_until(lambda: sum("error" in o for o in outcome) == 4, "the victim's 4 streaming requests to fail")
        # the victim's 2 silent requests went to the survivor: 4 waiting there now
        wait_until(lambda: server_info(survivor.target).num_requests_waiting == 4, "the retried requests")
    for t in threads:
        t.join(300)
    failed = [o for o in outcome if "error" in o]
    assert all(o["streamed"] and o["error"] == grpc.StatusCode.UNAVAILABLE for o in failed), outcome
    assert sum(o.get("ok", False) for o in outcome) == 8, outcome
    assert_blocks_all_back(survivor.target)
    assert round_robin.health() == "SERVING"
    info = server_info(round_robin.target)
    assert [r.health for r in info.replicas] == ["SERVING", "UNREACHABLE"]
    # what the router believed the dead replica cached is forgotten; the survivor's is kept
    assert info.replicas[1].indexed_tokens == 0 and info.replicas[0].indexed_tokens > 0

    # a new replica on the victim's address rejoins, and gets requests again
    port = victim.port
    orig = server_process.free_port
    ports = iter([port])                    # the gRPC port is the victim's; the metrics port is new
    server_process.free_port = lambda: next(ports, None) or orig()
    try:
        reborn = ServerProcess(tiny_llama_dir, xla_cache_dir, tmp_path_factory.mktemp("reborn") / "c.log")
    finally:
        server_process.free_port = orig
    try:
        reborn.wait_serving()
        wait_until(lambda: [r.health for r in server_info(round_robin.target).replicas] == ["SERVING"] * 2,
                   "the router to see the new replica")
        served = {generate(round_robin.target, [21, 22, 23], max_tokens=2, **GREEDY)[1]["jaxserve-replica"]
                  for _ in range(2)}
        assert served == {survivor.target, victim.target}
    finally:
        reborn.terminate()
        reborn.kill()
