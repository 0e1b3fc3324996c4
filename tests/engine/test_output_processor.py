"""The output processor's plain path (a one-token step of a request with one sample, no
logprobs, stop strings or prompt logprobs) builds exactly the outputs of its general path: the
same RequestOutputs, text, token ids, counters and metrics, step by step, for streamed,
cumulative and final-only outputs (which show nothing until they end), with requests finishing,
being aborted and joining on the way."""

from __future__ import annotations

import random

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.request_state import RequestState, SampleState
from jaxserve.outputs import RequestMetrics
from jaxserve.sampling_params import OutputKind, SamplingParams
from jaxserve.sched.scheduler_output import RequestUpdate
from jaxserve.testing.tiny_models import make_tokenizer


class _SchedRequest:
    """What process() reads of the scheduler's request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.num_cached_tokens = 0
        self.finish_reason = None
        self.stop_reason = None


def _state(tok, rid: str, kind: OutputKind, prompt: list[int]) -> RequestState:
    params = SamplingParams(max_tokens=1000, output_kind=kind)
    return RequestState(rid, None, list(prompt), params, RequestMetrics(0.0),
                        [SampleState(0, rid, IncrementalDetokenizer(tok, prompt))])


@pytest.mark.parametrize("kind", [OutputKind.DELTA, OutputKind.CUMULATIVE, OutputKind.FINAL_ONLY])
def test_the_plain_path_builds_the_general_paths_outputs(kind):
    tok = make_tokenizer()
    rng = random.Random(int(kind.value) if isinstance(kind.value, int) else 3)
    plain, general = OutputProcessor(), OutputProcessor()
    live: dict[str, _SchedRequest] = {}
    n = 0
    plain_steps = 0
    for step in range(60):
        if step % 5 == 0 or not live:        # requests join on the way
            for _ in range(rng.randrange(1, 4)):
                rid = f"r{n}"
                n += 1
                prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 6))]
                plain.add(_state(tok, rid, kind, prompt))
                general.add(_state(tok, rid, kind, prompt))
                for _, s in general._samples.values():
                    s.plain = False               # the general path for every step
                live[rid] = _SchedRequest(rid)
        updates = []
        for rid, req in list(live.items()):
            if rng.random() < 0.1:               # not in this step's updates (a prompt chunk)
                continue
            req.num_cached_tokens += rng.randrange(0, 2)
            finished = rng.random() < 0.08
            if finished:
                req.finish_reason = "length"
                del live[rid]
            updates.append(RequestUpdate(req, (rng.randrange(len(tok)),), finished))
        if live and rng.random() < 0.1:          # an abort between steps
            gone = rng.choice(sorted(live))
            plain.remove([gone], reason="abort")
            general.remove([gone], reason="abort")
            del live[gone]
        plain_steps += sum(1 for u in updates if u.request.request_id in plain and not u.finished
                           and plain._samples[u.request.request_id][1].plain)
        a = plain.process(updates, {}, float(step))
        b = general.process(updates, {}, float(step))
        assert a.outputs == b.outputs and a.stop_string_hits == b.stop_string_hits == []
        assert plain.counters == general.counters
    assert plain_steps > 100                     # the plain path really ran
    # and left every sample as the general path did (a final-only request shows it at its end)
    for rid, (state, sample) in general._samples.items():
        other = plain._samples[rid][1]
        assert (other.token_ids, other.detok.text, other.sent_tokens) == (sample.token_ids, sample.detok.text,
                                                                          sample.sent_tokens)


def test_requests_that_need_the_general_path_are_not_plain():
    tok = make_tokenizer()
    op = OutputProcessor()
    cases = {
        "stop": SamplingParams(max_tokens=10, stop=["x"]),
        "logprobs": SamplingParams(max_tokens=10, logprobs=2),
        "prompt_logprobs": SamplingParams(max_tokens=10, prompt_logprobs=1),
        "final": SamplingParams(max_tokens=10, output_kind=OutputKind.FINAL_ONLY),
        "plain": SamplingParams(max_tokens=10),
    }
    for rid, params in cases.items():
        detok = IncrementalDetokenizer(tok, [5], stop=tuple(params.stop or ()))
        op.add(RequestState(rid, None, [5], params, RequestMetrics(0.0),
                            [SampleState(0, rid, detok, logprobs=[] if params.logprobs is not None else None)]))
    assert {rid: op._samples[rid][1].plain for rid in cases} == {
        "stop": False, "logprobs": False, "prompt_logprobs": False, "final": True, "plain": True}
