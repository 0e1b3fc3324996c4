"""The scheduler: every step, which requests run and how many of their tokens.

There are no prefill and decode phases. Each request has `num_computed_tokens` (K/V cached) and
`num_tokens` (prompt + outputs); a step computes some of the difference for some requests, under a
token budget (`max_num_batched_tokens`) and a seat budget (`max_num_seqs`). Running requests go
first (a decode is 1 token, an unfinished prompt continues with its next chunk), then waiting
requests in queue order while budgets and blocks last. A request whose next token is the last
known one samples a new token this step.

When a running request needs a block and none is left, the most recently admitted running request
is preempted by recompute: its blocks are freed, it keeps its output tokens and goes back in front
of the waiting queue, and later re-prefills prompt + outputs, so its output does not change.

With prefix caching on, a request admitted from the waiting queue first shares the longest
cached prefix of its tokens (full blocks that earlier steps computed) and computes only the rest.
A fork child (`fork_request`: a parallel sample or a beam) waits until its parent has computed
their common prefix, then shares the parent's blocks; whoever first writes into a shared, partly
filled block gets a copy (`SchedulerOutput.block_copies`).

The engine's loop is: `schedule()` -> runner executes (copies first) -> `update(out, sampled)`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

from jaxserve.sched.kv_cache_manager import KVCacheManager, SharedPrefix, cdiv
from jaxserve.sched.request import FINISH_REASONS, Request, RequestStatus
from jaxserve.sched.request_queue import WaitingQueue
from jaxserve.sched.scheduler_config import SchedulerConfig
from jaxserve.sched.scheduler_output import RequestUpdate, ScheduledRequest, SchedulerOutput
from jaxserve.sched.stop_conditions import check_stop

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._requests: dict[str, Request] = {}  # live: waiting or running
        self._keys: dict[str, tuple] = {}  # queue key, kept across preemptions
        self._fork_parent: dict[str, str] = {}  # waiting fork child -> parent id
        self._seq = itertools.count()
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # admission order: the last is the first victim
        self.num_preemptions = 0
        self.num_kv_blocks_in_use_peak = 0  # most blocks in use after any schedule()

    # ---- the door -----------------------------------------------------------------------------
    def _validate(self, req: Request) -> None:
        c = self.config
        if req.request_id in self._requests:
            raise ValueError(f"request_id {req.request_id!r} is already in the scheduler")
        n = req.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {req.request_id!r}: the prompt is empty (0 tokens)")
        if n > c.max_model_len:
            raise ValueError(
                f"request {req.request_id!r}: the prompt has {n} tokens, more than max_model_len={c.max_model_len}"
            )
        if n + req.max_tokens > c.max_model_len:
            raise ValueError(
                f"request {req.request_id!r}: prompt ({n} tokens) + max_tokens ({req.max_tokens}) = "
                f"{n + req.max_tokens} exceeds max_model_len={c.max_model_len}"
            )
        # the last sampled token's K/V are never computed
        need = cdiv(n + req.max_tokens - 1, c.block_size)
        if need > self.kv.pool.num_total:
            raise ValueError(
                f"request {req.request_id!r}: prompt ({n} tokens) + max_tokens ({req.max_tokens}) needs "
                f"{need} KV blocks of {c.block_size} tokens, but the whole pool has {self.kv.pool.num_total}; "
                f"it could never run"
            )
        if req.status is not RequestStatus.WAITING or req.block_ids or req.num_computed_tokens:
            raise ValueError(f"request {req.request_id!r} is not fresh (status {req.status.name})")

    def add_request(self, req: Request) -> None:
        """Queue a new request; raises ValueError (with the numbers) if it is bad or could never run."""
        self._validate(req)
        self._requests[req.request_id] = req
        key = (next(self._seq), 0)
        self._keys[req.request_id] = key
        self.waiting.push(req, key)

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Queue `child`, a continuation of a live request (a parallel sample or a beam). It waits
        until the parent has computed their common prefix, then shares those blocks (copy-on-write
        for a partly filled last block) instead of computing them again."""
        parent = self._requests.get(parent_id)
        if parent is None:
            raise ValueError(f"fork_request: parent {parent_id!r} is not a live request")
        if child.cache_salt != parent.cache_salt:
            raise ValueError(
                f"fork_request: child cache_salt {child.cache_salt!r} differs from the parent's "
                f"{parent.cache_salt!r}; tenants never share blocks"
            )
        self._validate(child)
        self._requests[child.request_id] = child
        pkey = self._keys[parent_id]
        key = (pkey[0], next(self._seq) + 1)  # right behind the parent, in fork order
        self._keys[child.request_id] = key
        self._fork_parent[child.request_id] = parent_id
        self.waiting.push(child, key)

    # ---- a step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        c = self.config
        budget = c.max_num_batched_tokens
        out: list[ScheduledRequest] = []
        copies: list[tuple[int, int]] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, req.num_computed_tokens, budget)
            if n == 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n, copies):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself: everyone after it is gone too
            out.append(self._scheduled(req, n))
            budget -= n
            i += 1

        # Admitting after a preemption would only evict someone again next step.
        if not preempted:
            j = 0
            while j < len(self.waiting) and budget > 0 and len(self.running) < c.max_num_seqs:
                req = self.waiting[j]
                prefix = self._shared_prefix(req)
                if prefix is None:  # a fork child whose parent has not computed the prefix yet
                    j += 1
                    continue
                n = self._num_new_tokens(req, prefix.num_tokens, budget)
                if n == 0 or not self.kv.allocate_slots(req, n, copies, prefix):
                    break  # first come, first served: nobody overtakes the head
                first = req.status is RequestStatus.WAITING
                self.waiting.remove(req)
                self._fork_parent.pop(req.request_id, None)
                if first:
                    req.num_cached_tokens = min(prefix.num_tokens, req.num_prompt_tokens)
                    if not prefix.forked:  # the hit statistics describe the tree, not forks
                        self.kv.record_lookup(req, prefix)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.append(self._scheduled(req, n))
                budget -= n

        self.num_kv_blocks_in_use_peak = max(self.num_kv_blocks_in_use_peak, self.kv.pool.num_in_use)
        return SchedulerOutput(
            requests=tuple(out),
            num_batched_tokens=c.max_num_batched_tokens - budget,
            block_copies=tuple(copies),
            preempted_ids=tuple(preempted),
        )

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        """Tokens to compute for req this step (0 = it cannot run now)."""
        c = self.config
        n = req.num_tokens - num_computed
        if not c.enable_chunked_prefill:
            return n if n <= budget else 0
        if c.long_prefill_token_threshold:
            n = min(n, c.long_prefill_token_threshold)
        return min(n, budget)

    def _shared_prefix(self, req: Request) -> SharedPrefix | None:
        prefix = self.kv.find_cached_prefix(req)
        parent_id = self._fork_parent.get(req.request_id)
        if parent_id is None:
            return prefix
        parent = self._requests.get(parent_id)
        if parent is None:  # the parent ended: the child runs on its own
            del self._fork_parent[req.request_id]
            return prefix
        if parent.status is not RequestStatus.RUNNING:
            return None
        fork = self.kv.fork_prefix(parent, req)
        want = min(_common_prefix_len(parent.all_token_ids, req.all_token_ids), req.num_tokens - 1)
        if fork.num_tokens < want:
            return None  # wait for the parent's prefill to reach the shared prefix
        return fork if fork.num_tokens >= prefix.num_tokens else prefix

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        c0 = req.num_computed_tokens
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_slice(c0, c0 + n),
            num_computed_tokens=c0,
            block_ids=tuple(req.block_ids),
            sample=c0 + n == req.num_tokens,
            num_output_tokens=req.num_output_tokens,
            payload=req.payload,
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req, self._keys[req.request_id])

    # ---- after a step -------------------------------------------------------------------------
    def update(self, sched_out: SchedulerOutput, sampled: Mapping[str, int]) -> list[RequestUpdate]:
        """Record that the step ran: advance computed tokens, append sampled tokens, finish
        requests that hit a stop condition (their blocks are freed at once)."""
        updates: list[RequestUpdate] = []
        for sr in sched_out.requests:
            req = self._requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted or finished by the engine while the step ran
            if req.num_computed_tokens != sr.num_computed_tokens:
                raise ValueError(
                    f"update() for request {sr.request_id!r}: it has {req.num_computed_tokens} computed "
                    f"tokens but the step started from {sr.num_computed_tokens}; call update() once per schedule()"
                )
            req.num_computed_tokens += len(sr.token_ids)
            new: tuple[int, ...] = ()
            stop = None
            if sr.sample:
                if sr.request_id not in sampled:
                    raise ValueError(f"update(): no sampled token for request {sr.request_id!r}")
                tok = int(sampled[sr.request_id])
                req.output_token_ids.append(tok)
                new = (tok,)
                stop = check_stop(req, self.config.max_model_len)
            self.kv.cache_computed_blocks(req)
            if stop is not None:
                self._finish(req, *stop)
            updates.append(RequestUpdate(req, new, stop is not None))
        return updates

    # ---- ending requests from outside ---------------------------------------------------------
    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """End requests now (client gone, cancelled); unknown or finished ids are ignored."""
        return self.finish_requests(request_ids, "abort")

    def finish_requests(
        self, request_ids: Iterable[str], reason: str = "stop", stop_reason: int | str | None = None
    ) -> list[Request]:
        """End requests for a reason found outside the scheduler (a stop string: reason "stop",
        stop_reason the string). With reason "stop" and no stop_reason given, a stop_reason the
        engine already set on the request is kept. Unknown or finished ids are ignored. Returns the
        ended requests."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason must be one of {sorted(FINISH_REASONS)}, got {reason!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        ended = []
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is not None:
                keep = reason == "stop" and stop_reason is None
                self._finish(req, reason, req.stop_reason if keep else stop_reason)
                ended.append(req)
        return ended

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = FINISH_REASONS[reason]
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self._requests[req.request_id]
        del self._keys[req.request_id]
        self._fork_parent.pop(req.request_id, None)

    # ---- state and statistics -----------------------------------------------------------------
    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_kv_blocks_total(self) -> int:
        return self.kv.pool.num_total

    @property
    def num_kv_blocks_free(self) -> int:
        return self.kv.pool.num_free

    @property
    def num_kv_blocks_cached(self) -> int:
        """Blocks the prefix cache holds that no request uses (evictable)."""
        return self.kv.pool.num_cached

    @property
    def num_kv_blocks_in_use(self) -> int:
        return self.kv.pool.num_in_use

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv.prefix_cache_hits


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
