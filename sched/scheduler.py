"""The scheduler: every step, which requests run and how many of their tokens.

There are no prefill and decode phases. Each request has `num_computed_tokens` (K/V cached) and
`num_tokens` (prompt + outputs); a step computes some of the difference for some requests, under a
token budget (`max_num_batched_tokens`) and a seat budget (`max_num_seqs`). Running requests go
first, decodes (1 token each) before prefill chunks, so a long prompt's chunks take only the budget
the decodes leave; then waiting requests are admitted in queue order (see policy.py) while budget,
seats and blocks last. A request whose next token is the last known one samples a new token.

Admission is against projected KV use: blocks in use, plus the growth each running request is
expected to need (its prompt and a share of its remaining max_tokens), plus the newcomer's, must
fit the pool less a watermark, so a burst of admissions cannot force preemptions on the next token.
At most `max_num_partial_prefills` prompts are mid-prefill at once; a prompt that can finish this
step may overtake one that cannot, unless that one has waited `starvation_steps` steps.

When a running request needs a block and none is left, a victim (policy.py) is preempted: by
recompute (its blocks are freed; it keeps its outputs and re-prefills prompt + outputs later) or by
swap (its computed blocks are copied to a host pool and back into fresh blocks later). Either way
it goes back in front of the requests that arrived after it, and its output does not change.

With prefix caching on, an admitted request first shares the longest cached prefix of its tokens
(full blocks that earlier steps computed) and computes only the rest. A fork child (`fork_request`:
a parallel sample or a beam) waits until its parent has computed their common prefix, then shares
the parent's blocks; whoever first writes into a shared, partly filled block gets a copy.

The engine's loop: `schedule()` -> the runner performs `swap_out`, then `swap_in`, then
`block_copies`, then the step -> `update(out, sampled)`. With the one-step-ahead loop the engine
calls `schedule()` for step N+1 before `update()` for step N: `schedule()` advances
`num_computed_tokens` itself and counts each sample it schedules as a pending output, so a
decoding request is scheduled again with a placeholder for the token step N is sampling. A request
whose pending tokens already reach max_tokens or max_model_len is not scheduled again (it ends at
its update); one that ends by EOS, a stop id or a stop string may be in step N+1 already, whose
token for it `update()` then ignores. Requests with pending tokens are never admitted from the
waiting queue (their token ids are not all known), and a preempted request still takes the token
its last step sampled.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Mapping, Sequence

from jaxserve.sched.block_pool import BlockPool
from jaxserve.sched.errors import Overloaded
from jaxserve.sched.kv_cache_manager import KVCacheManager, SharedPrefix
from jaxserve.sched.kv_connector import HeldBlocks, KVConnector, KVLoading
from jaxserve.sched.limits import RequestLimits
from jaxserve.sched.admission import Admission
from jaxserve.sched.chunk_sizer import ChunkSizer
from jaxserve.sched.lora_slots import LoRASlots
from jaxserve.sched.preemption import Preemption
from jaxserve.sched.policy import FairShare, pick_victim
from jaxserve.sched.request import FINISH_REASONS, Request, RequestStatus, common_prefix_len
from jaxserve.sched.request_queue import WaitingQueue
from jaxserve.sched.scheduler_config import SchedulerConfig
from jaxserve.sched.scheduler_output import RequestUpdate, SchedulerOutput
from jaxserve.sched.scheduler_stats import SchedulerStats, snapshot
from jaxserve.sched.speculative_scheduling import Speculation, check_verified
from jaxserve.sched.step_cap import StepCap
from jaxserve.sched.step_plan import StepPlan
from jaxserve.sched.stop_conditions import append_until_stop, check_stop

__all__ = ["Overloaded", "Scheduler", "SchedulerConfig"]



class Scheduler:
    def __init__(self, config: SchedulerConfig, clock=time.perf_counter, draft_proposer=None) -> None:
        """draft_proposer (speculation method draft_model): called within schedule() with
        [(request, k)] once their blocks for k guesses are allocated; returns request id -> its
        guesses (the draft model's run, engine/draft_proposer.py)."""
        self.config = config
        # the time requests' arrival_time and first_token_time are on (read only with objectives)
        self._clock = clock
        # One host pool: swap preemption's blocks and the prefix cache's host tier (kv offload).
        # Its accounting reuses BlockPool, whose id 0 is reserved; the runner's host arrays have
        # no null block, so pool id h is host block h - 1 in SchedulerOutput.
        self.host_pool = BlockPool(config.num_host_blocks + 1, config.block_size) if config.num_host_blocks else None
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 host_pool=self.host_pool, host_tier=config.enable_kv_offload,
                                 kv_events=config.kv_events)
        self.limits = RequestLimits(config.max_model_len, config.block_size, self.kv.pool.num_total)
        self._requests: dict[str, Request] = {}  # live: waiting or running; the only per-request map
        self._seq = itertools.count()
        self._fair = FairShare(config.priority_weight_base)
        self._step = 0
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # admission order
        self.preemption = Preemption(config, self.kv)   # victims, swap or recompute, and their counts
        self.admission = Admission(config, self.kv)     # projected KV use and the watermark
        self.num_kv_blocks_in_use_peak = 0  # most blocks in use after any schedule()
        # chunk sizes, the time allowance and the step's predicted time (chunk_sizer.py)
        self.chunks = ChunkSizer(config, clock, self.running, self.waiting)
        # speculative decoding (None: off): the planner, the draft proposer, their counters
        self.speculation = Speculation(config, draft_proposer) if config.speculation is not None else None
        # LoRA adapters' device slots (lora_slots.py); None: the engine serves no adapters
        self.lora_slots = LoRASlots(config.max_loras) if config.max_loras else None
        # KV from elsewhere and KV held for a receiver (kv_connector.py; off until a connector is
        # attached): a request seated after its load takes a LoRA slot too
        self.kv_loads = KVLoading(config, self.kv, self.admission, lora_slots=self.lora_slots)
        # a bound below max_num_seqs and max_num_batched_tokens while buckets still warm up
        # (step_cap.py; set and raised by the engine's background warm-up: cap_steps); None: no bound
        self.step_cap: StepCap | None = None

    def cap_steps(self, cap: StepCap | None) -> None:
        """Bound the steps scheduled from now on to `cap` (None: none); read once per schedule()."""
        self.step_cap = cap

    # ---- the door -----------------------------------------------------------------------------
    def _validate(self, req: Request) -> None:
        c = self.config
        if req.request_id in self._requests:
            raise ValueError(f"request_id {req.request_id!r} is already in the scheduler")
        try:  # the engine's door ran the same check; this guards direct callers
            self.limits.check(req.num_prompt_tokens, req.max_tokens, req.min_tokens)
        except ValueError as e:
            raise ValueError(f"request {req.request_id!r}: {e}") from None
        if req.status is not RequestStatus.WAITING or req.block_ids or req.num_computed_tokens:
            raise ValueError(f"request {req.request_id!r} is not fresh (status {req.status.name})")

    def add_request(self, req: Request) -> None:
        """Queue a new request. Raises ValueError (with the numbers) if it is bad or could never
        run, and Overloaded if `max_waiting_requests` requests already wait beyond the free seats.

        The bound counts requests that cannot be admitted, not requests the scheduler has not
        looked at yet: a burst that arrives between two steps at an idle engine fills its free
        seats first (they are admitted at the next schedule()), and only what is left over queues."""
        self._validate(req)
        c = self.config
        if c.max_waiting_requests:
            free_seats = max(0, c.max_num_seqs - len(self.running))
            if len(self.waiting) - free_seats >= c.max_waiting_requests:
                raise Overloaded(len(self.waiting), c.max_waiting_requests, free_seats)
        seq = next(self._seq)
        if c.scheduling_policy == "priority":  # fair-share start tag; equal tags: more urgent first
            key = (self._fair.start_tag(req), req.priority, seq, 0)
        else:
            key = (seq, 0)
        self._enqueue(req, key)

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Queue `child`, a continuation of a live request (a parallel sample or a beam). It waits
        until the parent has computed their common prefix, then shares those blocks (copy-on-write
        for a partly filled last block) instead of computing them again. Forks are part of an
        accepted request, so the waiting-queue bound does not apply to them."""
        parent = self._requests.get(parent_id)
        if parent is None:
            raise ValueError(f"fork_request: parent {parent_id!r} is not a live request")
        if child.lora_key != parent.lora_key:
            raise ValueError(f"fork_request: child adapter {child.lora_name!r} differs from the parent's "
                             f"{parent.lora_name!r}; a fork shares its parent's adapter")
        if child.cache_salt != parent.cache_salt:
            raise ValueError(
                f"fork_request: child cache_salt {child.cache_salt!r} differs from the parent's "
                f"{parent.cache_salt!r}; tenants never share blocks"
            )
        self._validate(child)
        child.fork_parent_id = parent_id
        self._enqueue(child, parent.queue_key[:-1] + (next(self._seq) + 1,))  # right behind the parent

    def _enqueue(self, req: Request, key: tuple) -> None:
        self._requests[req.request_id] = req
        req.queue_key = key
        req.arrival_step = self._step
        self.waiting.push(req, key)

    # ---- a step -------------------------------------------------------------------------------
    def schedule(self, *, drafts: bool = False) -> SchedulerOutput:
        """drafts: decoding requests may carry speculative guesses (speculation.py) if this step
        turns out decode-only. The caller must not schedule the next step before this one's
        update(): how many tokens a verification yields is known only then."""
        self._step += 1
        cap = self.step_cap
        budget = self.config.max_num_batched_tokens
        st = StepPlan(budget if cap is None else min(cap.tokens, budget), self.config.chunk_granularity,
                      self.config.step_cost, self.lora_slots, self._step)
        self.kv.begin_step(st.swap_out, st.swap_in)
        self.admission.new_pass()     # the last step's update changed every running request
        for req in self.kv_loads.step(self.waiting, self.running):
            self._finish(req, "abort", None)   # a failed load under policy "fail" (engine: UNAVAILABLE)
        self._schedule_running(st, drafts and self.speculation is not None)
        # Admitting right after a preemption would only evict someone again next step.
        if not st.preempted:
            self.admission.new_pass()     # the running requests were just scheduled
            self._schedule_waiting(st)
        if st.host_freed:
            self.host_pool.free(st.host_freed)
        self.kv.release_pins()
        self.num_kv_blocks_in_use_peak = max(self.num_kv_blocks_in_use_peak, self.kv.pool.num_in_use)
        reqs = tuple(st.scheduled.values())
        return SchedulerOutput(
            requests=reqs,
            num_batched_tokens=sum(len(r.token_ids) for r in reqs),
            block_copies=tuple(st.copies),
            preempted_ids=tuple(st.preempted),
            swap_out=tuple((d, h - 1) for d, h in st.swap_out),
            swap_in=tuple((h - 1, d) for h, d in st.swap_in),
            predicted_s=self.chunks.predicted_seconds(st),
            kv_connector_ops=self.kv_loads.take_ops(),
            lora_loads=self.lora_slots.take_loads() if self.lora_slots is not None else (),
        )

    def observe_step_time(self, predicted_s: float, measured_s: float) -> None:
        """A step's measured time against its `predicted_s` (step_budget.StepTimeScale)."""
        self.chunks.step_time.observe(predicted_s, measured_s)

    @property
    def step_time_scale(self) -> float:
        return self.chunks.step_time.value

    def _schedule_running(self, st: StepPlan, drafts: bool = False) -> None:
        # a request whose pending tokens reach its limits ends at its update: nothing to schedule
        decodes: list[Request] = []
        prefills: list[Request] = []
        max_len = self.config.max_model_len
        for r in self.running:     # one pass: each request's counts read once
            pending = r.num_pending_output_tokens
            num_outputs = len(r.output_token_ids)
            known = len(r.prompt_token_ids) + num_outputs
            # pending tokens that already take it to max_tokens or max_model_len: it ends at its update
            if pending and (num_outputs + pending >= r.max_tokens or known + pending >= max_len):
                continue
            ahead = known + pending - r.num_computed_tokens
            if ahead == 1:
                decodes.append(r)
            elif ahead > 1:
                prefills.append(r)
        guesses = self.speculation.plan(decodes) if drafts and not prefills and not self._may_admit() else {}
        if not guesses:
            # the common step: each decode one token, then the prompts' chunks
            if not self._schedule_decodes(decodes, st):
                return
            decodes = []
        by_model: list[tuple[Request, int]] = []   # draft_model: guesses to ask for once blocks are there
        num_decodes = len(decodes)
        for i, req in enumerate(decodes + prefills):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if st.budget <= 0:
                break
            draft = guesses.get(req.request_id) if guesses else None
            if draft and st.budget >= 1 + len(draft) and self.kv.allocate_slots(req, 1 + len(draft), st.copies):
                # blocks for the guesses come only from what is free: never preempt for a guess
                if self.speculation.by_model:
                    by_model.append((req, len(draft)))
                    st.budget -= 1 + len(draft)
                else:
                    st.add(req, 1 + len(draft), draft=draft)
                continue
            # a decode's one token is what num_new_tokens gives it whenever budget is left (a
            # one-token chunk is never capped, and costs 1); not asked per request
            n = 1 if i < num_decodes else self.chunks.num_new_tokens(req, req.num_computed_tokens, st)
            if n == 0:
                continue
            while not self.kv.allocate_slots(req, n, st.copies):
                victim = pick_victim(self.running)
                self._preempt(victim, st)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                st.add(req, n)
        if by_model:
            self._schedule_model_drafts(by_model, st)

    def _schedule_decodes(self, decodes: list[Request], st: StepPlan) -> bool:
        """One token for each decode, in order, preempting for blocks as the general loop does;
        False once the budget is spent (nothing more fits in this step)."""
        kv, copies = self.kv, st.copies
        for req in decodes:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if st.budget <= 0:
                return False
            while not kv.allocate_slots(req, 1, copies):
                victim = pick_victim(self.running)
                self._preempt(victim, st)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                st.add_decode(req)
        return True

    def _schedule_model_drafts(self, by_model: list[tuple[Request, int]], st: StepPlan) -> None:
        """The draft model writes its K/V at the guesses' positions, so it runs once their blocks
        are allocated; a request preempted since (by a later one's allocation) is dropped."""
        live = [(r, k) for r, k in by_model if r.status is RequestStatus.RUNNING]
        st.budget += sum(1 + k for r, k in by_model)
        proposed = self.speculation.propose_by_model(live)
        for req, k in live:
            draft = list(proposed.get(req.request_id, ()))[:k]
            st.add(req, 1 + len(draft), draft=draft)

    def wants_drafts(self) -> bool:
        """Whether the next step would speculate if allowed: speculation is on, the step would be
        decode-only (no prompt mid-prefill, none to admit), and guesses would pay. The engine then
        runs that step without its one-step-ahead overlap (drafts need every token known on the host)."""
        if self.speculation is None or self._may_admit() or not self.running:
            return False
        if any(r.num_tokens_with_pending - r.num_computed_tokens > 1 for r in self.running):
            return False   # a prompt still prefilling: this step carries its chunk, not guesses
        return self.speculation.would_pay(self.running)

    def _may_admit(self) -> bool:
        """A request waits and a seat is free: the step may take in a prompt, which guesses would
        only delay (with every seat taken, guesses are what the step can add)."""
        return bool(self.waiting) and len(self.running) < self._seats()

    def _seats(self) -> int:
        cap = self.step_cap
        return self.config.max_num_seqs if cap is None else min(cap.seats, self.config.max_num_seqs)

    def _schedule_waiting(self, st: StepPlan) -> None:
        c = self.config
        j = 0
        made_room_for = None  # the request less urgent ones were just evicted for
        seats = self._seats()
        while j < len(self.waiting) and st.budget > 0 and len(self.running) < seats:
            req = self.waiting[j]
            if req.request_id in st.preempted:
                j += 1  # evicted in this step: it does not come straight back
                continue
            if req.num_pending_output_tokens:
                j += 1  # preempted with a token still on its way: its ids are not all known yet
                continue
            if req.remote_kv is not None:
                j += 1  # its KV comes from elsewhere once blocks allow (kv_connector.py)
                continue
            if self.lora_slots is not None and not self.lora_slots.can_admit(req):
                # every LoRA slot is held by running requests: it waits, others go past it until
                # it starves, then nothing is admitted behind it and the slots drain (lora_slots.py)
                if self._step - req.arrival_step >= c.starvation_steps:
                    break
                j += 1
                continue
            starving = self._step - req.arrival_step >= c.starvation_steps
            swapped = req.status is RequestStatus.SWAPPED
            prefix = SharedPrefix(num_tokens=req.num_computed_tokens) if swapped else self._shared_prefix(req, st)
            n = self.chunks.num_new_tokens(req, prefix.num_tokens, st) if prefix is not None else 0
            partial = prefix is not None and prefix.num_tokens + n < req.num_tokens
            capped = partial and c.max_num_partial_prefills and len(st.partial) >= c.max_num_partial_prefills
            if prefix is None or capped:
                # a fork child waiting for its parent's prefill, or a prompt that would be left
                # mid-prefill while the cap is reached: one that finishes this step may go first,
                # unless this one has starved or room was just made for it
                if (capped and starving) or req is made_room_for:
                    break
                j += 1
                continue
            if n == 0:
                break  # chunking off and the prompt does not fit what is left of the budget
            if not self._admit(req, prefix, n, st):
                evictable = self.preemption.less_urgent(req, self.running, st.admitted)
                if not evictable or not self.admission.admits_after_evicting(req, prefix, self.running, evictable):
                    break  # first come, first served: nobody overtakes the head
                victim = pick_victim(evictable)
                self._preempt(victim, st)  # priority policy: make room, then look again
                made_room_for = req
                j = self.waiting.index(req)  # the victim may have been queued in front of it
                continue
            first = req.status is RequestStatus.WAITING
            self.waiting.remove(req)
            req.fork_parent_id = None
            if first:
                req.num_cached_tokens = min(prefix.num_tokens, req.num_prompt_tokens)
                if not prefix.forked and not swapped:  # the hit statistics describe the tree
                    self.kv.record_lookup(req, prefix)
            if self.config.scheduling_policy == "priority":
                self._fair.admitted(req.queue_key[0])
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if self.lora_slots is not None:
                self.lora_slots.acquire(req)   # its adapter's slot, loaded into one if not resident
            st.admitted.add(req.request_id)
            st.add(req, n)

    def _admit(self, req: Request, prefix: SharedPrefix, n: int, st: StepPlan) -> bool:
        """Allocate blocks for a waiting request if projected KV use allows (False: nothing changed)."""
        if not self.admission.admits(req, prefix, self.running):
            return False
        reserve = self.admission.reserve(self.running)
        if req.status is RequestStatus.SWAPPED:
            host = req.host_block_ids
            dev = self.kv.swap_in(req, host, n, reserve)
            if dev is None:
                return False
            st.swap_in.extend(zip(host, dev))
            st.host_freed.extend(host)
            req.host_block_ids = []
            return True
        return self.kv.allocate_slots(req, n, st.copies, prefix, reserve)

    def _shared_prefix(self, req: Request, st: StepPlan) -> SharedPrefix | None:
        prefix = self.kv.find_cached_prefix(req)
        parent_id = req.fork_parent_id
        if parent_id is None:
            return prefix
        parent = self._requests.get(parent_id)
        if parent is None:  # the parent ended: the child runs on its own
            req.fork_parent_id = None
            return prefix
        if parent.status is not RequestStatus.RUNNING:
            return None
        # the parent's tokens computed by earlier steps only: its chunk in this step is not there yet
        this_step = st.scheduled.get(parent_id)
        fork = self.kv.fork_prefix(parent, req, this_step.num_computed_tokens if this_step else None)
        want = min(common_prefix_len(parent.all_token_ids, req.all_token_ids), req.num_tokens - 1)
        if fork.num_tokens < want:
            return None  # wait for the parent's prefill to reach the shared prefix
        return fork if fork.num_tokens >= prefix.num_tokens else prefix

    # ---- preemption ---------------------------------------------------------------------------
    def _preempt(self, victim: Request, st: StepPlan) -> None:
        """Evict a running request (possibly one already scheduled this step: it is taken out of
        the step again) by swap or recompute (preemption.py decides), and put it back in the
        waiting queue under its own key."""
        rid = victim.request_id
        pending_copy = st.take_back(victim)
        self.running.remove(victim)
        self.admission.new_pass()
        if self.lora_slots is not None:
            self.lora_slots.release(victim)
        # swap-outs run before the step's copies and swap-ins: a block still waiting for its
        # content cannot be saved, so such a victim is recomputed
        eviction = self.preemption.evict(victim, may_swap=not (pending_copy or rid in st.admitted))
        st.swap_out.extend(eviction.swap_out)
        st.preempted.append(rid)
        self.waiting.push(victim, victim.queue_key)

    def recompute_all(self) -> int:
        """Every request holding KV (running, or swapped out to the host pool) goes back to the
        waiting queue holding none, under its own queue key, as a preemption by recompute leaves
        it: it keeps its outputs and prefills prompt + outputs again when admitted. What a weight
        update does (engine/weight_update.py): K/V computed under the old weights must not be
        read under the new ones. Only between steps, with no step in flight. Returns how many."""
        moved = 0
        for req in list(self.running):
            if req.num_pending_output_tokens:
                raise RuntimeError(f"request {req.request_id!r} has a token in flight; collect the step first")
            self.running.remove(req)
            if self.lora_slots is not None:
                self.lora_slots.release(req)
            self.preemption.evict(req, may_swap=False)
            self.waiting.push(req, req.queue_key)
            moved += 1
        for req in list(self.waiting):
            if req.status is RequestStatus.SWAPPED:   # its host blocks hold K/V of the old weights
                self.preemption.drop_swapped(req)
                moved += 1
        return moved

    # ---- after a step -------------------------------------------------------------------------
    def update(self, sched_out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]) -> list[RequestUpdate]:
        """Record that the step ran: append each request's sampled tokens (`sampled[id]`, in order),
        cache newly full blocks, finish requests that hit a stop condition (their blocks are freed
        at once). Requests finished or aborted since the step was scheduled are skipped: the token
        a step computed for them is dropped. A request preempted since still takes its token."""
        updates: list[RequestUpdate] = []
        requests, kv, speculation = self._requests, self.kv, self.speculation
        max_model_len = self.config.max_model_len
        running = RequestStatus.RUNNING
        for sr in sched_out.requests:
            req = requests.get(sr.request_id)
            if req is None:
                continue  # finished or aborted while the step ran
            new: tuple[int, ...] = ()
            stop = None
            if sr.sample:
                got = sampled.get(sr.request_id)
                if got is None:
                    raise ValueError(f"update(): no sampled token for request {sr.request_id!r}")
                k = sr.num_draft_tokens
                new = (int(got[0]),) if len(got) == 1 else tuple(map(int, got))
                if k or len(new) != 1:
                    check_verified(sr, new)
                pending = req.num_pending_output_tokens
                if pending < 1:
                    raise ValueError(
                        f"update() for request {sr.request_id!r}: it has no pending token but the step "
                        f"sampled {len(new)}; call update() once per schedule()")
                req.num_pending_output_tokens = pending - 1
                outputs = req.output_token_ids
                if not outputs and req.first_token_time is None:
                    req.first_token_time = self._clock()
                if k:
                    speculation.verified(req, sr, len(new) - 1)
                    new, stop = append_until_stop(req, new, max_model_len)
                else:   # one token: nearly every update
                    outputs.append(new[0])
                    stop = check_stop(req, max_model_len)
                    if speculation is not None:
                        speculation.probe(req, new[0])
            if req.status is running:
                kv.cache_computed_blocks(req)
            if stop is not None:
                self._finish(req, *stop)
                updates.append(RequestUpdate(req, new, True))
            elif new or req.status is running:
                updates.append(RequestUpdate(req, new, False))
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
        rid = req.request_id
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.admission.new_pass()
        elif req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.waiting.remove(req)
        if self.lora_slots is not None:
            self.lora_slots.release(req)
        if not self.kv_loads.on_finish(req, reason):
            self.kv.free(req)
        if req.host_block_ids:
            self.host_pool.free(req.host_block_ids)
            req.host_block_ids = []
        req.status = FINISH_REASONS[reason]
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.fork_parent_id = None
        del self._requests[rid]

    # ---- state and statistics -----------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """One snapshot of the state and counters (scheduler_stats.py)."""
        return snapshot(self)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    # knobs an engine measures after it started (a cold server's deferred calibration)
    RETUNABLE = frozenset({"long_prefill_token_threshold", "decode_step_prefill_cap", "decode_step_prefill_caps",
                           "objectives", "step_cost", "swap_crossover_tokens"})

    def retune(self, **knobs) -> None:
        """Replace the chunk policy's and the swap crossover's knobs (RETUNABLE) from the next
        schedule() on: a new SchedulerConfig, validated as at start, for the scheduler and every
        part that reads it."""
        unknown = set(knobs) - self.RETUNABLE
        if unknown:
            raise ValueError(f"retune: {sorted(unknown)} are not retunable (only {sorted(self.RETUNABLE)})")
        old, new = self.config, dataclasses.replace(self.config, **knobs)
        self.config = new
        for part in vars(self).values():       # preemption, admission, KV loading, speculation
            if getattr(part, "config", None) is old:
                part.config = new

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (they return to the free list), e.g. after the KV arena was
        written by someone else. Only while no request holds blocks (waiting ones hold none):
        returns False, changing nothing, otherwise (their blocks may be shared with the tree)."""
        if self.kv.pool.num_in_use:
            return False
        if self.kv.cache is not None:
            self.kv.cache.clear()   # both tiers: nothing is saved to the host on the way out
        return self.kv.pool.num_cached == 0

    def has_unfinished_requests(self) -> bool:
        """Live requests, or KV-connector work decided but not yet in a step (a held lease's
        gather after its request ended): the engine runs a step for it."""
        return bool(self._requests) or self.kv_loads.has_ops

    # ---- the KV connector ---------------------------------------------------------------------
    def attach_kv_connector(self, connector: KVConnector, failure_policy: str = "recompute") -> None:
        """Load KV from elsewhere and hold finished kv_send requests' blocks through `connector`
        (the engine builder attaches one for a prefill or decode role)."""
        self.kv_loads.attach(connector, failure_policy)

    @property
    def kv_connector(self) -> KVConnector | None:
        return self.kv_loads.connector

    def free_held_blocks(self, held: HeldBlocks) -> None:
        """The receiver is done with blocks a hold took (or their lease expired)."""
        self.kv_loads.free_held_blocks(held)

    def only_waiting_for_kv(self) -> bool:
        """Every live request is a load in flight: a step would have nothing to compute."""
        return self.kv_loads.only_loading(len(self._requests))
