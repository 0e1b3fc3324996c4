"""Guesses from a draft model (speculation method "draft_model"): a smaller model with the same
tokenizer, run k decode steps ahead of the target on its own KV arena.

The draft's arena has the target's block count and block size, so the scheduler's block tables
index both: every step the engine runs on the target it also runs on the draft (the same
`SchedulerOutput`, block copies and swaps included; the draft's sampled tokens are dropped), so
the draft holds K/V for every position the target computed, prefix-cache hits and forks included.
Before a verification, `DraftModelProposer` runs k decode steps of the draft for the speculating
requests, at the positions the scheduler just allocated for their guesses; the verification then
writes the same positions again on both models. A greedy request's guesses are the draft's argmax
(point masses, kept while they equal the target's tokens). A sampled request's guesses are drawn
from the draft's own distribution q (its temperature, top-k, top-p and min-p, on keys of its own,
`draft_sampling`); the mirrored step draws the same tokens from the same q at the verification's
rows, and the target's sampler keeps each with probability min(1, p/q) (runner/sampler.py). Either
way the outputs follow the target's distribution exactly; only how many guesses are kept depends
on the draft.
Engines with a draft model run without the one-step-ahead loop (a placeholder would stand for a
token the draft's own sampler never saw).
"""

from __future__ import annotations

import dataclasses

from jaxserve.sched.request import Request
from jaxserve.sched.sampling import GREEDY, SamplingOptions
from jaxserve.sched.scheduler_output import ScheduledRequest, SchedulerOutput

# XORed into a request's seed for the draft's draws: they must be independent of the target's
# (which use the request's own keys)
DRAFT_SEED_SALT = 0x5EED_D4AF


class DraftModelProposer:
    def __init__(self, runner) -> None:
        self.runner = runner   # the draft model's ModelRunner

    def __call__(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """batch: (request, k): k guesses after each request's last token, one draft step each."""
        last = {req.request_id: req.token_slice(req.num_computed_tokens, req.num_computed_tokens + 1)[0]
                for req, _ in batch}   # one token, not a copy of prompt + outputs
        guesses: dict[str, list[int]] = {req.request_id: [] for req, _ in batch}
        for j in range(max((k for _, k in batch), default=0)):
            rows = tuple(
                ScheduledRequest(req.request_id, (last[req.request_id],), req.num_computed_tokens + j,
                                 req.block_table, True, req.num_output_tokens + j,
                                 draft_options(req.sampling))
                for req, k in batch if k > j)
            for rid, tokens in self.runner.execute(SchedulerOutput(rows, len(rows))).token_ids.items():
                last[rid] = tokens[0]
                guesses[rid].append(last[rid])
        return guesses


def draft_options(s: SamplingOptions) -> SamplingOptions:
    """How the draft samples for a request: greedy stays greedy; a sampled request keeps its
    temperature and filters, on keys of its own, without min_tokens' bans, logprobs or logit
    adjustments (any q is exact once the target verifies against it)."""
    if s.temperature <= 0:
        return GREEDY
    return SamplingOptions(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                           seed=(s.seed ^ DRAFT_SEED_SALT) & 0xFFFFFFFF)


def draft_sampling(sched_out: SchedulerOutput) -> SchedulerOutput:
    """A step as the draft model runs it: the same rows, each request sampling as draft_options says
    (no penalties, so without the tokens they count: the draft's seats keep no history of them)."""
    return dataclasses.replace(sched_out, requests=tuple(
        dataclasses.replace(r, sampling=draft_options(r.sampling), token_history=None) for r in sched_out.requests))
