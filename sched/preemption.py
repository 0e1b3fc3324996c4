"""Preemption: the scheduler's part that evicts a running request when blocks run out (or, under
the priority policy, for a more urgent waiting one), by swap to the host pool or by recompute.

A mixin of `Scheduler` (scheduler.py): it reads and changes the scheduler's queues, KV manager and
counters, and adds no state of its own. Either way the victim goes back to the waiting queue in
front of the requests that arrived after it, and its output does not change.
"""

from __future__ import annotations

from jaxserve.sched.kv_cache_manager import cdiv
from jaxserve.sched.policy import pick_victim
from jaxserve.sched.request import Request, RequestStatus


class Preemption:
    def _less_urgent_victim(self, req: Request, st) -> Request | None:
        """Under the priority policy, a waiting request may evict a less urgent running one (not
        one admitted in this very step: its swap-in or first chunk is not even computed yet)."""
        if self.config.scheduling_policy != "priority":
            return None
        parent = req.fork_parent_id  # a fork child never evicts its own parent
        less_urgent = [
            r for r in self.running
            if r.priority > req.priority and r.request_id not in st.admitted and r.request_id != parent
        ]
        return pick_victim(less_urgent) if less_urgent else None

    def _preempt(self, victim: Request, st) -> None:
        """Evict a running request (possibly one already scheduled this step: it is taken out of
        the step again) by swap or recompute, and put it back in the waiting queue."""
        rid = victim.request_id
        pending_copy = False
        sr = st.scheduled.pop(rid, None)
        if sr is not None:  # undo what _add_scheduled advanced
            st.budget += len(sr.token_ids) if sr.num_draft_tokens else self._charge(len(sr.token_ids))
            st.partial.discard(rid)
            victim.num_computed_tokens = sr.num_computed_tokens
            if sr.sample:
                victim.num_pending_output_tokens -= 1
            mine = set(victim.block_ids)
            kept = [(s, d) for s, d in st.copies if d not in mine]
            pending_copy = len(kept) != len(st.copies)
            st.copies[:] = kept
        self.running.remove(victim)
        # swap-outs run before the step's copies and swap-ins: a block still waiting for its
        # content cannot be saved, so such a victim is recomputed
        pending = pending_copy or rid in st.admitted
        if not pending and self._should_swap(victim):
            k = cdiv(victim.num_computed_tokens, self.config.block_size)
            host = self.kv.take_host(k)
            st.swap_out.extend(zip(victim.block_ids[:k], host))
            victim.host_block_ids = host
            self.kv.free(victim)
            victim.status = RequestStatus.SWAPPED
            self.num_preemptions_swap += 1
            self.num_swapped_blocks += k
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            self.num_preemptions_recompute += 1
        victim.num_preemptions += 1
        st.preempted.append(rid)
        self.waiting.push(victim, victim.queue_key)

    def _should_swap(self, req: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or req.num_computed_tokens == 0:
            return False
        if cdiv(req.num_computed_tokens, self.config.block_size) > self.kv.num_host_available:
            return False  # the host pool is full (swapped requests): recompute instead
        if mode == "swap":
            return True
        # auto: recompute is cheaper below the crossover length the engine measured; blocks still
        # in the prefix cache would be found again, so they do not count as lost work
        lost = req.num_computed_tokens - self.kv.num_cached_prefix_tokens(req)
        return lost >= self.config.swap_crossover_tokens

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
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            req.num_preemptions += 1
            self.num_preemptions_recompute += 1
            self.waiting.push(req, req.queue_key)
            moved += 1
        for req in list(self.waiting):
            if req.status is RequestStatus.SWAPPED:   # its host blocks hold K/V of the old weights
                self.host_pool.free(req.host_block_ids)
                req.host_block_ids = []
                req.num_computed_tokens = 0
                req.status = RequestStatus.PREEMPTED
                moved += 1
        return moved
