"""The scheduler's component for speculative decoding (speculation.py): whether a step would
speculate, the guesses each decoding request takes (n-gram lookup, or a draft model asked once
the guesses' blocks are allocated), and taking back rejected guesses at update.

It owns the planner, the draft proposer and the speculation counters; the scheduler (scheduler.py)
owns the step and puts the guesses in it. `host_seconds_per_step` is written by the engine: what
running a step without the one-step-ahead overlap costs, which a speculating step must make up for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxserve.sched.ngram_proposer import propose_ngram
from jaxserve.sched.request import Request, RequestStatus
from jaxserve.sched.scheduler_config import SchedulerConfig
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN, ScheduledRequest
from jaxserve.sched.speculation import DraftPlanner, record_verification
from jaxserve.sched.step_cost import lookup_seconds

# a request that decodes without guesses is probed (Speculation.probe) once every this many
# tokens: often enough to notice a change within a few dozen tokens, rarely enough that its
# lookups cost nothing at a large batch
PROBE_EVERY = 4


class Speculation:
    def __init__(self, config: SchedulerConfig, draft_proposer: Callable | None = None) -> None:
        spec = config.speculation
        if spec.method == "draft_model" and draft_proposer is None:
            raise ValueError("speculation method 'draft_model' needs a draft_proposer")
        self.config = config
        self.draft_proposer = draft_proposer
        table, draft = config.decode_step_seconds, config.draft_step_seconds
        self.planner = DraftPlanner(spec, config.max_decode_rows or config.max_num_seqs,
                                    (lambda rows: lookup_seconds(table, rows)) if table else None,
                                    (lambda reqs: lookup_seconds(draft, reqs)) if draft else None)
        self.host_seconds_per_step = 0.0
        self.num_draft_tokens = 0       # guesses verified
        self.num_accepted_tokens = 0    # of those, accepted
        self.num_verifications = 0      # request-steps that verified guesses

    @property
    def by_model(self) -> bool:
        return self.draft_proposer is not None

    def would_pay(self, running: Sequence[Request]) -> bool:
        """Whether a decode-only step of these requests would speculate: a full set of guesses
        pays for this batch, at the requests' acceptance so far."""
        k = self.config.speculation.num_speculative_tokens
        return self.planner.plan([(r, range(k if self.may_draft(r) else 0)) for r in running],
                                 self.host_seconds_per_step) > 0

    def may_draft(self, req: Request) -> bool:
        # guesses must fit max_tokens and max_model_len: a verification appends up to k + 1 tokens
        # (counted with the tokens in flight, which are known by the time a guessing step is scheduled)
        return (req.sampling.allows_drafts and req.num_outputs_with_pending > 0
                and req.max_tokens - req.num_outputs_with_pending > 1
                and self.config.max_model_len - req.num_tokens_with_pending > 1)

    def plan(self, decodes: Sequence[Request]) -> dict[str, list[int]]:
        """Guesses for this step's decodes: each one's n-gram proposal (placeholders for a draft
        model, asked once blocks are there), cut to the planner's k."""
        spec = self.config.speculation
        proposals = []
        for req in decodes:
            if req.num_pending_output_tokens or not self.may_draft(req):
                proposals.append((req, []))
                continue
            room = min(spec.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                       self.config.max_model_len - req.num_tokens - 1)
            if self.by_model:
                proposals.append((req, [PLACEHOLDER_TOKEN] * room))
                continue
            proposals.append((req, propose_ngram(req.all_token_ids, room, spec.prompt_lookup_min,
                                                 spec.prompt_lookup_max)))
        for req, p in proposals:
            if not p and not req.num_pending_output_tokens and self.may_draft(req):
                record_verification(req, 1, 0)   # a lookup that finds nothing counts as a wrong guess
        k = self.planner.plan(proposals, self.host_seconds_per_step)
        return {r.request_id: list(p[:k]) for r, p in proposals if k and p}

    def propose_by_model(self, live: Sequence[tuple[Request, int]]) -> dict[str, Sequence[int]]:
        """The draft model's guesses for requests whose blocks for k guesses are allocated."""
        return self.draft_proposer(list(live)) if live else {}

    def probe(self, req: Request, token: int) -> None:
        """A request that took a token without guesses: every PROBE_EVERY tokens, would the n-gram
        lookup have guessed it? A free trial (host only) that keeps its acceptance rate current,
        so a request judged unrepetitive speculates again once its text starts repeating."""
        spec = self.config.speculation
        if self.by_model or req.num_output_tokens % PROBE_EVERY or not req.sampling.allows_drafts:
            return
        guess = propose_ngram(req.all_token_ids[:-1], 1, spec.prompt_lookup_min, spec.prompt_lookup_max)
        record_verification(req, 1, int(guess == [token]))

    def verified(self, req: Request, sr: ScheduledRequest, accepted: int) -> None:
        """A verification kept `accepted` of its guesses: the K/V of the rejected ones hold the
        wrong tokens, so they are computed again (overwritten) from the token sampled instead."""
        k = sr.num_draft_tokens
        if req.status is RequestStatus.RUNNING:
            req.num_computed_tokens -= k - accepted
        record_verification(req, k, accepted)
        self.num_verifications += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted


def check_verified(sr: ScheduledRequest, new: tuple[int, ...]) -> None:
    """A step's tokens for sr: one sampled token, after the guesses it accepted, if any."""
    k = sr.num_draft_tokens
    if (len(new) != 1 if not k else
            not 1 <= len(new) <= 1 + k or new[:-1] != sr.draft_token_ids[:len(new) - 1]):
        raise ValueError(f"update(): request {sr.request_id!r} got tokens {new} for guesses "
                         f"{sr.draft_token_ids}: expected the accepted guesses and one sampled token")
