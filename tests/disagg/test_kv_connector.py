"""The scheduler's KV connector seam (sched/kv_connector.py), in pure Python: a sending and a
receiving scheduler, each on a fake KV arena that holds token ids (tests/sched/sched_testkit.py),
joined by a loopback connector that copies blocks between the arenas with their ids remapped.
Both sides of the seam are exercised as the engine runs them: the scheduler side decides (poll,
hold), the runner side writes and gathers (`apply`, called by the fake runner with each step's
`kv_connector_ops`, after its swaps).
A wrong remap, a load written into the wrong blocks or a late write into reused blocks changes the
context the fake model reads, and with it the outputs compared to the model run alone."""

from __future__ import annotations

import pytest

from jaxserve.sched.kv_connector import HeldBlocks, KVLoad, KVLoadResult, LiveLoads, RemoteKV
from jaxserve.sched.request import RequestStatus
from jaxserve.sched.scheduler import Scheduler, SchedulerConfig
from tests.sched.sched_testkit import (FakeRunner, assert_outputs_match_reference, check_drained, check_invariants,
                                       drive, make_request)

BS = 4
MAX_LEN = 96


class LoopbackConnector:
    """Both sides in one process. `fail` names request ids whose loads fail; `deliver=False`
    keeps loads in flight until the test calls `deliver()`."""

    def __init__(self, sender_runner: FakeRunner | None = None, receiver_runner: FakeRunner | None = None,
                 *, held: dict[str, HeldBlocks] | None = None, fail: dict[str, str] | None = None,
                 deliver: bool = True):
        self.sender_runner, self.receiver_runner = sender_runner, receiver_runner
        if receiver_runner is not None:
            receiver_runner.connector_worker = self   # the receiving engine's runner side
        self.held: dict[str, HeldBlocks] = {} if held is None else held   # the sender's
        self.live = LiveLoads()
        self.started: list[KVLoad] = []
        self.cancelled: list[tuple[str, int]] = []
        self.released: list[RemoteKV] = []
        self.fail = fail or {}
        self.auto = deliver
        self._arrived: list[KVLoad] = []
        self.gathered: list[str] = []      # held blocks the runner side gathered (save ops)
        self.writes: list[str] = []        # loads the runner side wrote (load ops)
        self._ok: dict[tuple[str, int], KVLoad] = {}   # polled ok, waiting for their op

    # sending side
    def hold(self, held: HeldBlocks) -> None:
        self.held[held.request_id] = held

    # the runner side
    def apply(self, ops) -> None:
        for held in ops.saves:
            assert self.held[held.request_id] is held
            self.gathered.append(held.request_id)
        for load in ops.loads:
            assert self._ok.pop((load.request_id, load.generation)) == load
            src = self.held[load.remote.transfer_id].block_ids
            for i, dst in enumerate(load.dst_block_ids):
                self.receiver_runner.kv[dst] = self.sender_runner.kv[src[load.first_block + i]]
            self.writes.append(load.request_id)

    # receiving side
    def num_matched_tokens(self, request) -> int:
        return request.remote_kv.num_tokens if request.remote_kv is not None else 0

    def start_load(self, load: KVLoad) -> None:
        self.live.add(load)
        self.started.append(load)
        if self.auto:
            self._arrived.append(load)

    def deliver(self, load: KVLoad) -> None:
        """The bytes of `load` arrive now (possibly long after it was cancelled)."""
        self._arrived.append(load)

    def poll(self) -> list[KVLoadResult]:
        results = []
        for load in self._arrived:
            if self.live.take(load.request_id, load.generation) is None:
                continue   # cancelled meanwhile: the blocks may be someone else's, nothing is written
            why = self.fail.get(load.request_id)
            if why:
                results.append(KVLoadResult(load.request_id, load.generation, False, why))
                continue
            self._ok[(load.request_id, load.generation)] = load   # written by its op, at dispatch
            results.append(KVLoadResult(load.request_id, load.generation, True))
        self._arrived = []
        return results

    def cancel_load(self, request_id: str, generation: int) -> None:
        self._ok.pop((request_id, generation), None)
        if self.live.cancel(request_id, generation) is not None:
            self.cancelled.append((request_id, generation))

    def release_remote(self, remote: RemoteKV) -> None:
        self.released.append(remote)


def _sched(conn=None, policy="recompute", **kw) -> Scheduler:
    s = Scheduler(SchedulerConfig(**{"num_blocks": 64, "block_size": BS, "max_model_len": MAX_LEN, **kw}))
    if conn is not None:
        s.attach_kv_connector(conn, policy)
    return s


def _run_until_done(sched: Scheduler, runner: FakeRunner, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
    raise AssertionError("the workload did not finish")


def _prefill(prompts: dict[str, list[int]]):
    """The sending side: each prompt computed with max_tokens=1 and its blocks held."""
    runner = FakeRunner(64, BS)
    conn = LoopbackConnector(runner)
    runner.connector_worker = conn
    sender = _sched(conn)
    for rid, prompt in prompts.items():
        req = make_request(rid, prompt, max_tokens=1, ignore_eos=True)
        req.kv_send = True
        sender.add_request(req)
    _run_until_done(sender, runner)
    # each held prompt was gathered by a step after its request ended (the scheduler kept
    # has_unfinished_requests() true for it, with no request left)
    assert sorted(conn.gathered) == sorted(prompts) and not sender.kv_loads.has_ops
    return sender, runner, conn


def _remote(conn: LoopbackConnector, rid: str) -> RemoteKV:
    held = conn.held[rid]
    return RemoteKV("sender:1", rid, 1, held.num_tokens)


def test_loaded_requests_decode_as_if_they_had_prefilled_here():
    prompts = {f"r{i}": make_request(f"r{i}", n).prompt_token_ids for i, n in enumerate((5, 8, 13, 30))}
    sender, s_runner, s_conn = _prefill(prompts)
    # the sender keeps every prompt's blocks: in use, not free, until the receiver is done
    assert sender.kv.pool.num_in_use == sum(-(-len(p) // BS) for p in prompts.values())
    assert {h.num_tokens for h in s_conn.held.values()} == {len(p) for p in prompts.values()}

    r_runner = FakeRunner(64, BS)
    r_conn = LoopbackConnector(s_runner, r_runner, held=s_conn.held)
    receiver = _sched(r_conn)
    reqs = []
    for rid, prompt in prompts.items():
        req = make_request(rid, prompt, max_tokens=6, ignore_eos=True)
        req.remote_kv = _remote(s_conn, rid)
        reqs.append(req)
    drive(receiver, reqs, runner=r_runner)
    assert_outputs_match_reference(reqs, MAX_LEN)
    # each load brought all but the last prompt token, into the receiver's own blocks
    assert [l.num_tokens for l in r_conn.started] == [len(p) - 1 for p in prompts.values()]
    assert receiver.stats().kv_loads_done == len(prompts) and not receiver.stats().kv_load_fallbacks
    assert sorted(r_conn.writes) == sorted(prompts) and not r_conn._ok   # every load written by its op
    assert all(r.num_cached_tokens == 0 for r in reqs)   # nothing came from the local prefix cache

    for held in s_conn.held.values():
        sender.free_held_blocks(held)
    check_drained(sender)


def test_a_local_prefix_hit_is_not_loaded_again():
    prompt = make_request("p", 26).prompt_token_ids
    sender, s_runner, s_conn = _prefill({"a": prompt})
    r_runner = FakeRunner(64, BS)
    r_conn = LoopbackConnector(s_runner, r_runner, held=s_conn.held)
    receiver = _sched(r_conn)
    local = make_request("local", prompt[:17] + [5, 6, 7], max_tokens=2, ignore_eos=True)
    drive(receiver, [local], runner=r_runner)      # caches the first 4 full blocks here
    req = make_request("a", prompt, max_tokens=4, ignore_eos=True)
    req.remote_kv = _remote(s_conn, "a")
    drive(receiver, [req], runner=r_runner)
    assert_outputs_match_reference([local, req], MAX_LEN)
    (load,) = r_conn.started
    assert load.first_block == 4 and len(load.dst_block_ids) == -(-25 // BS) - 4
    assert req.num_cached_tokens == 16


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_is_recomputed_or_fails_by_policy(policy):
    prompts = {"ok": make_request("ok", 9).prompt_token_ids, "bad": make_request("bad", 11).prompt_token_ids}
    _, s_runner, s_conn = _prefill(prompts)
    r_runner = FakeRunner(64, BS)
    receiver = _sched(LoopbackConnector(s_runner, r_runner, held=s_conn.held, fail={"bad": "timeout"}), policy)
    reqs = {rid: make_request(rid, p, max_tokens=5, ignore_eos=True) for rid, p in prompts.items()}
    for rid, req in reqs.items():
        req.remote_kv = _remote(s_conn, rid)
    drive(receiver, reqs.values(), runner=r_runner)
    assert dict(receiver.stats().kv_load_fallbacks) == {"timeout": 1}
    if policy == "recompute":
        assert_outputs_match_reference(reqs.values(), MAX_LEN)   # prefilled here instead
        assert receiver.kv_loads.errors == []
    else:
        assert reqs["bad"].finish_reason == "abort" and not reqs["bad"].output_token_ids
        assert [rid for rid, _ in receiver.kv_loads.errors] == ["bad"]
        assert "timeout" in receiver.kv_loads.errors[0][1]
        assert_outputs_match_reference([reqs["ok"]], MAX_LEN)


def test_a_layout_mismatch_fails_even_under_recompute():
    _, s_runner, s_conn = _prefill({"x": make_request("x", 9).prompt_token_ids})
    receiver = _sched(LoopbackConnector(s_runner, FakeRunner(64, BS), held=s_conn.held, fail={"x": "layout"}), "recompute")
    req = make_request("x", make_request("x", 9).prompt_token_ids, max_tokens=3)
    req.remote_kv = _remote(s_conn, "x")
    receiver.add_request(req)
    receiver.schedule()
    assert req.finish_reason == "abort" and receiver.kv_loads.errors[0][0] == "x"
    check_drained(receiver)


def test_abort_while_loading_frees_blocks_and_a_late_arrival_is_dropped():
    prompt = make_request("p", 21).prompt_token_ids
    _, s_runner, s_conn = _prefill({"a": prompt, "b": prompt[:3] + [9] * 18})
    r_runner = FakeRunner(64, BS)
    conn = LoopbackConnector(s_runner, r_runner, held=s_conn.held, deliver=False)
    receiver = _sched(conn, enable_prefix_caching=False, num_blocks=7)   # 6 usable: b must reuse a's
    req = make_request("a", prompt, max_tokens=4, ignore_eos=True)
    req.remote_kv = _remote(s_conn, "a")
    receiver.add_request(req)
    out = receiver.schedule()
    assert out.is_empty and req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert receiver.only_waiting_for_kv()
    (load,) = conn.started
    assert receiver.kv.pool.num_in_use == len(load.dst_block_ids) == 5

    receiver.abort_requests(["a"])
    assert conn.cancelled == [("a", load.generation)]
    check_drained(receiver)

    # another request takes the freed blocks; then the aborted load's bytes arrive, late
    other = make_request("b", prompt[:3] + [9] * 18, max_tokens=3, ignore_eos=True)
    receiver.add_request(other)
    first = receiver.schedule()
    assert set(first.requests[0].block_ids) & set(load.dst_block_ids), "the test needs the blocks reused"
    receiver.update(first, r_runner.execute(first, receiver))
    conn.deliver(load)
    _run_until_done(receiver, r_runner)     # the fake model reads a wrong context if anything was written
    assert_outputs_match_reference([other], MAX_LEN)
    assert conn.live.num_stale == 1
    check_drained(receiver)


def test_a_loaded_request_waits_for_a_seat():
    prompts = {f"s{i}": make_request(f"s{i}", 10).prompt_token_ids for i in range(3)}
    _, s_runner, s_conn = _prefill(prompts)
    r_runner = FakeRunner(64, BS)
    receiver = _sched(LoopbackConnector(s_runner, r_runner, held=s_conn.held), max_num_seqs=1)
    reqs = []
    for rid, p in prompts.items():
        r = make_request(rid, p, max_tokens=3, ignore_eos=True)
        r.remote_kv = _remote(s_conn, rid)
        reqs.append(r)
    drive(receiver, reqs, runner=r_runner, on_step=lambda step, out: check_invariants(receiver))
    assert_outputs_match_reference(reqs, MAX_LEN)


def test_live_loads_take_only_the_matching_generation():
    live = LiveLoads()
    load = KVLoad("a", 7, RemoteKV("p", "a", 1, 9), 0, (3, 4), 8)
    live.add(load)
    assert live.take("a", 6) is None and live.num_stale == 1
    assert live.cancel("a", 6) is None
    assert live.take("a", 7) is load
    assert live.take("a", 7) is None and live.num_stale == 2    # a duplicate
    with pytest.raises(ValueError):
        live.add(load); live.add(load)
