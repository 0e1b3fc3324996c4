"""Test support for the scheduler: a fake runner whose "model" reads its context back from a fake
KV arena, a loop that drives the scheduler to completion, and the invariants checked every step.

The fake arena stores token ids in slots (block, offset). The fake model's next token is a hash of
the context it reads back through the block table, so a wrong block table, a missing copy-on-write
copy or a reused block that still held someone else's K/V changes the output tokens, and outputs
can be compared with `reference_output`, which runs the same model with no scheduler at all.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxserve.sched.request import Request, RequestStatus
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN, SchedulerOutput

EOS = 2
VOCAB = 64


def _mix(x: int) -> int:
    # splitmix64's finaliser: every output bit depends on every input bit
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 % (1 << 64)
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB % (1 << 64)
    return x ^ (x >> 31)


def next_token(context: Sequence[int], vocab: int = VOCAB) -> int:
    """A deterministic 'model': a hash of the whole context; ids 0 and 1 never come out."""
    h = 0x9E3779B97F4A7C15
    for t in context:
        h = _mix(h + int(t) + 1)
    return 2 + h % (vocab - 2)


def make_request(rid: str, prompt: Sequence[int] | int, max_tokens: int = 8, *, seed: int = 0, **kw) -> Request:
    """A request whose prompt is given, or `prompt` random tokens (ids >= 3, so never EOS)."""
    if isinstance(prompt, int):
        rng = np.random.default_rng([zlib.crc32(rid.encode()), seed])  # stable across processes
        prompt = rng.integers(3, VOCAB, size=prompt).tolist()
    kw.setdefault("eos_token_ids", frozenset({EOS}))
    return Request(rid, list(prompt), max_tokens, **kw)


def short_memory_token(context: Sequence[int]) -> int:
    """A 'model' that sees only the last two tokens and says one of ten: its outputs soon cycle,
    so n-gram guesses (speculative decoding) are often right, as on repetitive text."""
    return next_token(context[-2:], 12)


def reference_output(req: Request, max_model_len: int, model=next_token) -> tuple[list[int], str, int | None]:
    """What the request must produce: the fake model run alone, with the stop rules restated."""
    tokens = list(req.prompt_token_ids)
    out: list[int] = []
    while True:
        t = model(tokens)
        tokens.append(t)
        out.append(t)
        if len(out) >= req.min_tokens:
            if not req.ignore_eos and t in req.eos_token_ids:
                return out, "stop", None
            if t in req.stop_token_ids:
                return out, "stop", t
        if len(out) >= req.max_tokens or len(tokens) >= max_model_len:
            return out, "length", None


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, model=next_token) -> None:
        self.model = model
        self.block_size = block_size
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)  # [block, offset] -> token
        self.host: dict[int, np.ndarray] = {}  # host pool: swapped blocks and the prefix cache's host tier
        self.num_copies = 0
        self.num_swapped_out = 0
        self.connector_worker = None   # a KV connector's runner side: applies each step's kv_connector_ops

    def execute(self, out: SchedulerOutput, sched: Scheduler,
                pending: Mapping[str, int] | None = None) -> dict[str, list[int]]:
        """Run one step. `pending[id]` is the token the previous, not yet updated step sampled for
        id: what a placeholder stands for (the real runner reads it on the device)."""
        pending = pending or {}
        bs = self.block_size
        for dev, host in out.swap_out:
            self.host[host] = self.kv[dev].copy()
            self.num_swapped_out += 1
        for host, dev in out.swap_in:
            assert host in self.host, f"host block {host} is read but holds nothing"
            self.kv[dev] = self.host[host]
        if out.kv_connector_ops and self.connector_worker is not None:
            self.connector_worker.apply(out.kv_connector_ops)
        for src, dst in out.block_copies:
            assert src != dst and 0 not in (src, dst)
            self.kv[dst] = self.kv[src]
            self.num_copies += 1
        written: set[tuple[int, int]] = set()
        for sr in out.requests:
            assert 0 not in sr.block_ids, "the null block is never in a real block table"
            end = sr.num_computed_tokens + len(sr.token_ids)
            assert len(sr.block_ids) * bs >= end
            for p, t in zip(range(sr.num_computed_tokens, end), sr.token_ids):
                if t == PLACEHOLDER_TOKEN:
                    t = pending[sr.request_id]
                slot = (sr.block_ids[p // bs], p % bs)
                assert slot not in written, f"two requests write slot {slot} in one step"
                written.add(slot)
                self.kv[slot] = t
        sampled = {}
        for sr in out.requests:
            end = sr.num_computed_tokens + len(sr.token_ids)
            ctx = [int(self.kv[sr.block_ids[p // bs], p % bs]) for p in range(end)]
            req = sched.get_request(sr.request_id)
            from_before = req.num_pending_output_tokens - sr.sample  # sampled by the step before this one
            known = req.all_token_ids + ([pending[sr.request_id]] if from_before else []) + list(sr.draft_token_ids)
            assert ctx == known[:end], f"{sr.request_id}: the KV arena holds the wrong context"
            if sr.num_draft_tokens:
                # a row per token: guess j is kept while it equals the token sampled the row before
                k = sr.num_draft_tokens
                rows = [self.model(ctx[:end - k + j]) for j in range(k + 1)]
                kept = 0
                while kept < k and rows[kept] == sr.draft_token_ids[kept]:
                    kept += 1
                sampled[sr.request_id] = rows[:kept + 1]
            elif sr.sample:
                sampled[sr.request_id] = [self.model(ctx)]
        # blocks nobody holds lose their content: a later read of one shows as a wrong context
        pool = sched.kv.pool
        for b in pool.free_block_ids():
            self.kv[b] = -1
        if sched.host_pool is not None:   # the same for host blocks (pool id h is host block h - 1)
            for h in sched.host_pool.free_block_ids():
                self.host.pop(h - 1, None)
        return sampled


def check_invariants(sched: Scheduler) -> None:
    """Block accounting after any step: every reference is a live request's, nothing leaks."""
    pool = sched.kv.pool
    assert pool.num_free + pool.num_cached + pool.num_in_use == pool.num_total
    held: dict[int, int] = {}
    live = list(sched.running) + list(sched.waiting) + sched.kv_loads.requests()   # + KV on its way
    for req in live:
        if req.status is not RequestStatus.SWAPPED:
            assert len(set(req.block_ids)) == len(req.block_ids), f"{req.request_id} holds a block twice"
            assert req.block_table == tuple(req.block_ids), f"{req.request_id}: a stale block table"
            for b in req.block_ids:
                held[b] = held.get(b, 0) + 1
        if req.status.is_waiting and req.status is not RequestStatus.SWAPPED:
            assert not req.block_ids and req.num_computed_tokens == 0
    free = pool.free_block_ids()
    for b in range(1, pool.num_blocks):
        assert pool.refcount(b) == held.get(b, 0), f"block {b}: refcount {pool.refcount(b)}, held {held.get(b, 0)}"
        assert not (b in free and b in held), f"block {b} is both free and referenced"
        assert not (b in free and pool.is_cached(b)), f"block {b} is both free and cached"
    assert pool.num_in_use == len(held)
    assert len(sched.running) <= sched.config.max_num_seqs
    cache = sched.kv.cache
    host = sched.host_pool
    host_nodes = []
    if cache is not None:
        nodes = cache.all_nodes()
        on_device = [n for n in nodes if n.on_device]
        host_nodes = [n for n in nodes if not n.on_device]
        assert len({n.block_id for n in on_device}) == len(on_device), "a block appears twice in the tree"
        assert sum(1 for n in on_device if pool.refcount(n.block_id) == 0) == pool.num_cached
        assert all(n.host_id == 0 for n in on_device) and all(n.host_id > 0 for n in host_nodes)
        assert len({n.host_id for n in host_nodes}) == len(host_nodes), "a host block appears twice in the tree"
        for n in host_nodes:   # the device part of the tree is closed under ancestors
            assert not any(c.on_device for c in n.children.values()), f"{n!r} has a child on the device"
            assert host.is_cached(n.host_id) and host.refcount(n.host_id) == 0
        for n in on_device:
            assert n.device_children == sum(1 for c in n.children.values() if c.on_device)
        for req in sched.running:  # each request's cached nodes are exactly its leading blocks
            for j, n in enumerate(sched.kv._nodes.get(req.request_id, [])):
                assert n.attached and n.block_id == req.block_ids[j]
    if host is not None:   # host: free + cached (the host tier) + in use (swapped requests) == total
        swapped = [b for r in sched.waiting if r.status is RequestStatus.SWAPPED for b in r.host_block_ids]
        assert host.num_free + host.num_cached + host.num_in_use == host.num_total
        assert host.num_cached == len(host_nodes)
        assert host.num_in_use == len(swapped) == len(set(swapped))


def check_drained(sched: Scheduler) -> None:
    """After a workload: no request left, and free + cached == total."""
    assert not sched.has_unfinished_requests()
    assert sched.stats().num_running == 0 and sched.stats().num_waiting == 0
    pool = sched.kv.pool
    assert pool.num_in_use == 0
    assert pool.num_free + pool.num_cached == pool.num_total
    check_invariants(sched)


def drive(
    sched: Scheduler,
    requests: Iterable[Request] = (),
    *,
    arrivals: dict[int, list[Request]] | None = None,
    on_step: Callable[[int, SchedulerOutput], None] | None = None,
    runner: FakeRunner | None = None,
    max_steps: int = 20_000,
    one_step_ahead: bool = False,
    on_update: Callable[[int], None] | None = None,
    speculate: bool = False,
) -> dict[str, Request]:
    """Run until every request finished. `arrivals[step]` are added before that step's schedule().
    With `one_step_ahead`, step N+1 is scheduled and run before step N's update, as the engine's
    asynchronous loop does; `on_update(step)` runs after each update (e.g. to abort requests).
    With `speculate`, a step the scheduler wants to speculate in is scheduled with drafts after
    the step in flight is updated, as the engine does. Returns all requests by id (finished)."""
    cfg = sched.config
    runner = runner or FakeRunner(cfg.num_blocks, cfg.block_size)
    seen: dict[str, Request] = {}
    for r in requests:
        sched.add_request(r)
        seen[r.request_id] = r
    arrivals = dict(arrivals or {})
    step = 0
    in_flight: tuple[SchedulerOutput, dict[str, list[int]]] | None = None
    while sched.has_unfinished_requests() or arrivals or in_flight:
        for r in arrivals.pop(step, []):
            sched.add_request(r)
            seen[r.request_id] = r
        drafts = speculate and sched.wants_drafts()
        if drafts and in_flight is not None:   # drafts need every token known: finish the step in flight
            sched.update(*in_flight)
            in_flight = None
        out = sched.schedule(drafts=drafts)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len({s.request_id for s in out.requests}) == len(out.requests)
        if sched.has_unfinished_requests() and not arrivals and not in_flight:
            assert out.requests or out.preempted_ids, f"step {step}: nothing scheduled, the scheduler is stuck"
        check_invariants(sched)
        pending = {rid: toks[-1] for rid, toks in in_flight[1].items()} if in_flight else {}
        sampled = runner.execute(out, sched, pending)
        if one_step_ahead and not drafts:
            if in_flight is not None:
                sched.update(*in_flight)
            in_flight = (out, sampled) if out.requests else None
        else:
            sched.update(out, sampled)
        check_invariants(sched)
        if on_update is not None:
            on_update(step)
        if on_step is not None:
            on_step(step, out)
        step += 1
        assert step < max_steps, "the workload did not finish"
    check_drained(sched)
    return seen


def assert_outputs_match_reference(reqs: Iterable[Request], max_model_len: int, model=next_token) -> None:
    for r in reqs:
        if r.finish_reason == "abort":
            continue
        want, reason, stop_reason = reference_output(r, max_model_len, model)
        assert r.output_token_ids == want, f"{r.request_id}: outputs differ from the model run alone"
        assert (r.finish_reason, r.stop_reason) == (reason, stop_reason), r.request_id
