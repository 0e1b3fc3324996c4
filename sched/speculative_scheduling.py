"""The scheduler's part in speculative decoding (speculation.py): whether a step would speculate,
the guesses each decoding request takes (n-gram lookup, or a draft model asked once the guesses'
blocks are allocated), and taking back rejected guesses at update.

A mixin of `Scheduler` (scheduler.py): it reads the scheduler's requests, config and planner and
adds nothing to its state but the speculation counters.
"""

from __future__ import annotations

from jaxserve.sched.ngram_proposer import propose_ngram
from jaxserve.sched.request import Request, RequestStatus
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN, ScheduledRequest
from jaxserve.sched.speculation import record_verification


# a request that decodes without guesses is probed (speculative_scheduling._probe_acceptance)
# once every this many tokens: often enough to notice a change within a few dozen tokens, rarely
# enough that its lookups cost nothing at a large batch
PROBE_EVERY = 4


class SpeculativeScheduling:
    def _schedule_model_drafts(self, by_model: list[tuple[Request, int]], st) -> None:
        """The draft model writes its K/V at the guesses' positions, so it runs once their blocks
        are allocated; a request preempted since (by a later one's allocation) is dropped."""
        live = [(r, k) for r, k in by_model if r.status is RequestStatus.RUNNING]
        st.budget += sum(1 + k for r, k in by_model)
        proposed = self._draft_proposer(live) if live else {}
        for req, k in live:
            draft = list(proposed.get(req.request_id, ()))[:k]
            self._add_scheduled(req, 1 + len(draft), st, draft=draft)

    def wants_drafts(self) -> bool:
        """Whether the next step would speculate if allowed: speculation is on, the step would be
        decode-only (no prompt mid-prefill, none to admit), and guesses would pay. The engine then runs that step
        without its one-step-ahead overlap (drafts need every token known on the host)."""
        if self._planner is None or self._may_admit() or not self.running:
            return False
        if any(r.num_tokens_with_pending - r.num_computed_tokens > 1 for r in self.running):
            return False   # a prompt still prefilling: this step carries its chunk, not guesses
        # would a full set of guesses pay for this batch, at the requests' acceptance so far?
        k = self.config.speculation.num_speculative_tokens
        return self._planner.plan([(r, range(k if self._may_draft(r) else 0)) for r in self.running],
                                  self.host_seconds_per_step) > 0

    def _may_admit(self) -> bool:
        """A request waits and a seat is free: the step may take in a prompt, which guesses would
        only delay (with every seat taken, guesses are what the step can add)."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def _may_draft(self, req: Request) -> bool:
        # guesses must fit max_tokens and max_model_len: a verification appends up to k + 1 tokens
        # (counted with the tokens in flight, which are known by the time a guessing step is scheduled)
        return (req.sampling.allows_drafts and req.num_outputs_with_pending > 0
                and req.max_tokens - req.num_outputs_with_pending > 1
                and self.config.max_model_len - req.num_tokens_with_pending > 1)

    def _plan_drafts(self, decodes: list[Request]) -> dict[str, list[int]]:
        """Guesses for this step's decodes: each one's n-gram proposal, cut to the planner's k."""
        spec = self.config.speculation
        proposals = []
        for req in decodes:
            if req.num_pending_output_tokens or not self._may_draft(req):
                proposals.append((req, []))
                continue
            room = min(spec.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                       self.config.max_model_len - req.num_tokens - 1)
            if self._draft_proposer is not None:
                # the draft model always has k guesses; which they are is asked once blocks are there
                proposals.append((req, [PLACEHOLDER_TOKEN] * room))
                continue
            proposals.append((req, propose_ngram(req.all_token_ids, room, spec.prompt_lookup_min,
                                                 spec.prompt_lookup_max)))
        for req, p in proposals:
            if not p and not req.num_pending_output_tokens and self._may_draft(req):
                record_verification(req, 1, 0)   # a lookup that finds nothing counts as a wrong guess
        k = self._planner.plan(proposals, self.host_seconds_per_step)
        return {r.request_id: list(p[:k]) for r, p in proposals if k and p}

    def _probe_acceptance(self, req: Request, token: int) -> None:
        """A request that took a token without guesses: every PROBE_EVERY tokens, would the n-gram
        lookup have guessed it? A free trial (host only) that keeps its acceptance rate current,
        so a request judged unrepetitive speculates again once its text starts repeating."""
        spec = self.config.speculation
        if (self._planner is None or self._draft_proposer is not None
                or req.num_output_tokens % PROBE_EVERY or not req.sampling.allows_drafts):
            return
        guess = propose_ngram(req.all_token_ids[:-1], 1, spec.prompt_lookup_min, spec.prompt_lookup_max)
        record_verification(req, 1, int(guess == [token]))

    def _verified(self, req: Request, sr: ScheduledRequest, accepted: int) -> None:
        """A verification kept `accepted` of its guesses: the K/V of the rejected ones hold the
        wrong tokens, so they are computed again (overwritten) from the token sampled instead."""
        k = sr.num_draft_tokens
        if req.status is RequestStatus.RUNNING:
            req.num_computed_tokens -= k - accepted
        record_verification(req, k, accepted)
        self.spec_num_verifications += 1
        self.spec_num_draft_tokens += k
        self.spec_num_accepted_tokens += accepted
