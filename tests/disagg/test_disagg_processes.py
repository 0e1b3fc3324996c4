"""Disaggregated prefill and decode as real processes on loopback (tiny model): a prefill engine,
a decode engine and the router pairing them.

- Behind the router, greedy outputs are token for token those of a colocated engine, and the
  block accounting is whole on both sides afterwards (every lease acknowledged).
- The prefill engine stopped (SIGSTOP) after it handed over a lease: the decode engine's own
  deadline fires, the request is recomputed there; after SIGCONT the late transfer is dropped by
  the generation check; no block leaks on either side.
- Behind the router, a stopped prefill engine costs the first long request one prefill-hop
  deadline (the decode engine prefills it) and later ones none (the engine is suspect), all with
  the unstopped tokens; after SIGCONT it serves hops again and holds no lease.
- A client deadline while the KV is in flight aborts the request and frees its blocks on both sides.
- The prefill engine killed after the hand-over: with policy `fail` the client gets UNAVAILABLE,
  with `recompute` the answer. (Last: it kills the shared prefill engine.)
Nothing here waits on a wall-clock window for something to happen: deadlines are generous and
every wait is a poll with a guard that only turns a hang into a failure.
"""

from __future__ import annotations

import os
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from jaxserve.bench.disagg_interference import kv_metrics
from jaxserve.proto import generation_pb2 as pb
from jaxserve.proto import generation_pb2_grpc as pb_grpc
from tests.router.router_process import RouterProcess, server_info
from tests.server.server_process import ServerProcess, wait_until

# Three server processes per run (about a minute of CI's 2 cores): opt-in. By default the same
# paths run in-process: the pairing (test_router_pairing.py), the lease and its deadlines
# (test_lease_and_receiver.py), the transfer (test_kv_transfer.py, test_kv_connector.py).
pytestmark = pytest.mark.slow

LOAD_TIMEOUT_S = 4.0
MAX_TOKENS = 10
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 30)] + [[7, 9] * 22, [7, 9] * 22 + [11, 12, 13]]
THRESHOLD = 8     # the 5-token prompt skips the prefill engine
PREFILL_LEASE_S = 20     # outlives a stop of a few seconds; bounds a lease nobody acknowledges
CLIENT_DEADLINE_S = 60.0


def _serve(model, cache, path, *flags):
    return ServerProcess(model, cache, path, *flags)


@pytest.fixture(scope="module")
def prefill(tiny_llama_dir, xla_cache_dir, tmp_path_factory):
    p = _serve(tiny_llama_dir, xla_cache_dir, tmp_path_factory.mktemp("prefill") / "p.log",
               "--role", "prefill", "--kv-lease-s", str(PREFILL_LEASE_S))
    p.wait_serving()        # its compile fills the cache the others load from
    yield p
    p.kill()


@pytest.fixture(scope="module")
def decode(tiny_llama_dir, xla_cache_dir, tmp_path_factory, prefill):
    d = _serve(tiny_llama_dir, xla_cache_dir, tmp_path_factory.mktemp("decode") / "d.log",
               "--role", "decode", "--kv-load-timeout-s", str(LOAD_TIMEOUT_S))
    d.wait_serving()
    yield d
    d.kill()


def _request(ids, rid="", max_tokens=MAX_TOKENS, **kv):
    return pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=ids),
                              sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True), **kv)


def _tokens(target, req, timeout=120) -> tuple[list[int], list[pb.GenerateResponse]]:
    with grpc.insecure_channel(target) as ch:
        msgs = list(pb_grpc.GenerationStub(ch).Generate(req, timeout=timeout))
    return [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids], msgs


def _lease(prefill, ids, rid) -> pb.RemoteKV:
    """The prefill hop, as the router makes it: one token, the KV held, the lease named."""
    _, msgs = _tokens(prefill.target, _request(ids, rid, max_tokens=1, kv_transfer=pb.KVTransfer(send=True)))
    lease = msgs[-1].complete.kv_lease
    assert lease.transfer_id == rid and lease.num_tokens == len(ids)
    return pb.RemoteKV(peer=prefill.target, transfer_id=lease.transfer_id, generation=lease.generation,
                       num_tokens=lease.num_tokens)


def _load(ids, remote, rid):
    return _request(ids, rid, kv_transfer=pb.KVTransfer(load=remote))


def metrics(server) -> dict[str, float]:
    return kv_metrics(server.metrics_port)


def blocks_whole(server) -> bool:
    i = server_info(server.target)
    return i.num_kv_blocks_free + i.num_kv_blocks_cached == i.num_kv_blocks_total


def assert_blocks_whole(*servers):
    for s in servers:
        wait_until(lambda: blocks_whole(s), f"every KV block of {s.target} free or cached")


@pytest.mark.slow   # three server processes (~1.5 min); the pairing and the transfer run in-process by default
def test_behind_the_router_outputs_equal_a_colocated_engine(prefill, decode, tiny_llama_dir, xla_cache_dir,
                                                             tmp_path_factory):
    d = tmp_path_factory.mktemp("pd-router")
    colocated = _serve(tiny_llama_dir, xla_cache_dir, d / "c.log")
    router = RouterProcess([], d / "router.log", "--prefill", prefill.target, "--decode", decode.target,
                           "--prefill-threshold-tokens", str(THRESHOLD), "--model", tiny_llama_dir)
    try:
        colocated.wait_serving()
        router.wait_serving()
        want = [_tokens(colocated.target, _request(p))[0] for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:     # concurrently: loads overlap decodes
            got = list(pool.map(lambda p: _tokens(router.target, _request(p))[0], PROMPTS))
        assert got == want
        assert all(len(t) == MAX_TOKENS for t in got)
        hops = sum(len(p) >= THRESHOLD for p in PROMPTS)
        m = metrics(decode)
        assert m["jaxserve_kv_transfers_total"] == hops
        assert m["jaxserve_kv_transfer_bytes_total"] > 0
        assert not any(k.startswith("jaxserve_kv_load_fallbacks_total") for k in m), m
        assert_blocks_whole(prefill, decode)
        assert metrics(prefill)["jaxserve_kv_leases_released_total"] == hops
        text = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=10).read().decode()
        assert f'jaxserve_router_prefill_hops_total{{outcome="kv_handed_over"}} {float(hops)}' in text
    finally:
        assert router.stop() == 0, router.log()
        colocated.kill()


def test_a_stopped_prefill_engine_costs_a_recompute_and_its_late_transfer_is_dropped(prefill, decode):
    ids = PROMPTS[2]
    want, _ = _tokens(decode.target, _request(ids))       # the decode engine prefilling it itself
    # One transfer first, so the decode engine knows the prefill engine's KV layout: the stop below
    # then catches a PullKV on the wire, bounded by kv_load_timeout_s + kv_lease_s (34 s), well past
    # the load's 4 s deadline. On a first contact it caught the layout handshake instead, whose own
    # bound is min(5 s, kv_load_timeout_s), the deadline itself: whichever 4 s timer fired first won,
    # and when the handshake's did, the load just failed with reason "timeout" and nothing arrived
    # late (the drop went uncounted in 4 of 7 runs; when it was counted, it was the handshake's
    # timeout ending after the deadline, before SIGCONT, not a late transfer).
    transfers = metrics(decode)["jaxserve_kv_transfers_total"]
    assert _tokens(decode.target, _load(ids, _lease(prefill, ids, "stopped-warm"), "stopped-warm"))[0] == want
    assert metrics(decode)["jaxserve_kv_transfers_total"] == transfers + 1     # the KV came: the layout is known
    remote = _lease(prefill, ids, "stopped-1")
    before = metrics(decode)
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        got, _ = _tokens(decode.target, _load(ids, remote, "stopped-1"))   # waits for its own deadline
        assert got == want
        m = metrics(decode)
        assert m['jaxserve_kv_load_fallbacks_total{reason="timeout"}'] == \
            before.get('jaxserve_kv_load_fallbacks_total{reason="timeout"}', 0) + 1
        assert m["jaxserve_kv_transfers_total"] == before["jaxserve_kv_transfers_total"]
        # the pull is still on the wire (the prefill engine is stopped): nothing late has arrived yet
        assert m["jaxserve_kv_stale_transfers_dropped_total"] == before["jaxserve_kv_stale_transfers_dropped_total"]
        assert_blocks_whole(decode)
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    stale = before["jaxserve_kv_stale_transfers_dropped_total"] + 1
    wait_until(lambda: metrics(decode)["jaxserve_kv_stale_transfers_dropped_total"] == stale,
               "the late transfer, dropped by its generation")
    assert metrics(decode)["jaxserve_kv_transfers_total"] == before["jaxserve_kv_transfers_total"]   # never written
    assert_blocks_whole(prefill, decode)


def test_a_deadline_while_the_kv_is_in_flight_frees_blocks_on_both_sides(prefill, decode):
    ids = PROMPTS[3]
    remote = _lease(prefill, ids, "deadline-1")
    assert not blocks_whole(prefill)                      # held for the receiver
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as e:
            _tokens(decode.target, _load(ids, remote, "deadline-1"), timeout=1.0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert_blocks_whole(decode)                       # aborted while loading: its blocks are back
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    assert_blocks_whole(prefill)                          # the cancelled load acknowledged the lease


def test_a_lease_of_other_tokens_is_refused_and_the_prompt_recomputed(prefill, decode):
    ids = PROMPTS[2]
    other = _lease(prefill, [t + 1 for t in ids], "other-1")     # same length, other tokens
    before = metrics(decode).get('jaxserve_kv_load_fallbacks_total{reason="other_tokens"}', 0)
    got, _ = _tokens(decode.target, _load(ids, other, "mine-1"))
    assert got == _tokens(decode.target, _request(ids))[0]
    assert metrics(decode)['jaxserve_kv_load_fallbacks_total{reason="other_tokens"}'] == before + 1
    assert_blocks_whole(decode, prefill)     # the refused pull acknowledged the lease too


def _router_metrics(router) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=10).read().decode()


def _hops(text: str, outcome: str) -> float:
    line = next((l for l in text.splitlines() if l.startswith(f'jaxserve_router_prefill_hops_total{{outcome="{outcome}"}}')),
                None)
    return float(line.split()[-1]) if line else 0.0


def _router_health_of(router, target: str) -> str:
    return next(r.health for r in server_info(router.target).replicas if r.target == target)


def test_behind_the_router_a_stopped_prefill_engine_costs_one_hop_deadline_and_holds_no_lease(
        prefill, decode, tiny_llama_dir, tmp_path_factory):
    prompts = PROMPTS[1:]       # every one takes the prefill hop (the router's threshold is 0)
    router = RouterProcess([], tmp_path_factory.mktemp("pd-router-stopped") / "router.log", "--prefill",
                           prefill.target, "--decode", decode.target, "--model", tiny_llama_dir)
    try:
        router.wait_serving()
        want = [_tokens(router.target, _request(p))[0] for p in prompts]      # unstopped: the KV handed over
        assert _hops(_router_metrics(router), "kv_handed_over") == len(prompts)
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        try:
            got = []
            for p in prompts:
                try:
                    got.append(_tokens(router.target, _request(p), timeout=CLIENT_DEADLINE_S)[0])
                except grpc.RpcError as e:   # before the hop's deadline: DEADLINE_EXCEEDED, the client's 60 s
                    pytest.fail(f"a request behind a stopped prefill engine ended {e.code().name}: {e.details()}")
            assert got == want                                  # the decode engine prefilled them
            text = _router_metrics(router)
            # the first paid the hop's deadline and made the engine suspect; the others skipped it
            assert _hops(text, "prefill_timeout") == 1
            assert _hops(text, "prefill_unavailable") == len(prompts) - 1
            assert _router_health_of(router, prefill.target) == "SUSPECT"
        finally:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        wait_until(lambda: _router_health_of(router, prefill.target) == "SERVING", "the prefill engine answering")
        # the abandoned hop was cancelled: aborted when the engine read the cancel, or, had it granted
        # the lease first, released when that lease ran out (--kv-lease-s)
        wait_until(lambda: metrics(prefill)["jaxserve_kv_leases_live"] == 0, "no lease held on the prefill engine",
                   guard_s=PREFILL_LEASE_S + 60)
        assert_blocks_whole(prefill, decode)
        assert _tokens(router.target, _request(prompts[0]))[0] == want[0]   # and it takes hops again
        assert _hops(_router_metrics(router), "kv_handed_over") == len(prompts) + 1
    finally:
        assert router.stop() == 0, router.log()


@pytest.mark.slow   # kills and restarts a server process per policy (~40 s); a stopped prefill engine runs by default
def test_a_killed_prefill_engine_costs_unavailable_or_a_recompute_by_policy(prefill, decode, tiny_llama_dir,
                                                                             xla_cache_dir, tmp_path_factory):
    strict = _serve(tiny_llama_dir, xla_cache_dir, tmp_path_factory.mktemp("strict") / "s.log", "--role", "decode",
                    "--kv-load-timeout-s", str(LOAD_TIMEOUT_S), "--kv-load-failure-policy", "fail")
    try:
        strict.wait_serving()
        ids = PROMPTS[1]
        want, _ = _tokens(decode.target, _request(ids))
        a, b = _lease(prefill, ids, "killed-1"), _lease(prefill, ids + [5], "killed-2")
        prefill.kill()
        with pytest.raises(grpc.RpcError) as e:
            _tokens(strict.target, _load(ids, a, "killed-1"))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "KV load failed" in e.value.details()
        got, _ = _tokens(decode.target, _load(ids + [5], b, "killed-2"))
        assert got == _tokens(decode.target, _request(ids + [5]))[0]
        # behind the router, a dead prefill engine costs the prefill hop, not the answer
        router = RouterProcess([], tmp_path_factory.mktemp("pd-router-dead") / "router.log", "--prefill",
                               prefill.target, "--decode", decode.target, "--model", tiny_llama_dir)
        try:
            router.wait_serving()
            assert _tokens(router.target, _request(ids))[0] == want
            text = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=10).read()
            assert b'jaxserve_router_prefill_hops_total{outcome="prefill_unavailable"} 1.0' in text
        finally:
            assert router.stop() == 0, router.log()
        assert_blocks_whole(strict, decode)
    finally:
        strict.kill()
