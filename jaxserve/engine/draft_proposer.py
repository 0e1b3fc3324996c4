"""Guesses from a draft model (speculation method "draft_model"): a smaller model with the same
tokenizer, run k decode steps ahead of the target on its own KV arena.

The draft's arena has the target's block count and block size, so the scheduler's block tables
index both: every step the engine runs on the target it also runs on the draft (the same
`SchedulerOutput`, block copies and swaps included; the draft's sampled tokens are dropped), so
the draft holds K/V for every position the target computed, prefix-cache hits and forks included.
Before a verification, `DraftModelProposer` runs k greedy decode steps of the draft for the
speculating requests, at the positions the scheduler just allocated for their guesses; the
verification then writes the same positions again on both models. A draft's guess is its argmax,
verified like an n-gram guess (kept while it equals the token the target samples), so outputs are
exactly the target's whatever the draft says: only how many guesses are kept depends on it.
Engines with a draft model run without the one-step-ahead loop (a placeholder would stand for a
token the draft's own sampler never saw).
"""

from __future__ import annotations

from jaxserve.sched.request import Request
from jaxserve.sched.sampling import GREEDY
from jaxserve.sched.scheduler_output import ScheduledRequest, SchedulerOutput


class DraftModelProposer:
    def __init__(self, runner) -> None:
        self.runner = runner   # the draft model's ModelRunner

    def __call__(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """batch: (request, k): k guesses after each request's last token, one draft step each."""
        last = {req.request_id: req.all_token_ids[req.num_computed_tokens] for req, _ in batch}
        guesses: dict[str, list[int]] = {req.request_id: [] for req, _ in batch}
        for j in range(max((k for _, k in batch), default=0)):
            rows = tuple(
                ScheduledRequest(req.request_id, (last[req.request_id],), req.num_computed_tokens + j,
                                 tuple(req.block_ids), True, req.num_output_tokens + j, GREEDY)
                for req, k in batch if k > j)
            sampled = self.runner.execute(SchedulerOutput(rows, len(rows))).sampled
            for rid, tokens in sampled.items():
                last[rid] = tokens[0].token_id
                guesses[rid].append(last[rid])
        return guesses
