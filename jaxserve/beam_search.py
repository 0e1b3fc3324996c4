"""Beam search on top of the engine, as vLLM's LLM.beam_search does it.

Every round asks the engine for one token per live beam with the top 2 * beam_width logprobs;
the beams are the best `beam_width` extensions by cumulative logprob. Each beam is resubmitted as
prompt + its tokens, so the prefix cache shares every ancestor's full KV blocks between beams
and rounds: only the last partial block is recomputed. The final choice follows HF transformers:
score = cumulative logprob / (generated length ** length_penalty), EOS ends a beam unless
ignore_eos.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width!r} must be in [1, {MAX_LOGPROBS // 2}]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens={self.max_tokens!r} must be an integer >= 1")


@dataclass(slots=True)
class BeamSequence:
    tokens: list[int]                     # generated tokens (the prompt excluded)
    cum_logprob: float = 0.0
    finished: bool = False
    text: str = ""

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / (max(1, len(self.tokens)) ** length_penalty)


@dataclass(slots=True)
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)   # best first


def beam_search(llm, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    eos = llm.engine.eos_token_ids
    tok = llm.get_tokenizer()
    k = params.beam_width
    results = []
    for prompt in prompts:
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else tok.encode(prompt)
        running = [BeamSequence([])]
        finished: list[BeamSequence] = []
        for _ in range(params.max_tokens):
            step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * k, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": list(ids) + b.tokens} for b in running], step,
                                use_tqdm=False)
            candidates = []
            for beam, out in zip(running, outs):
                for token, lp in out.outputs[0].logprobs[0].items():
                    candidates.append((beam.cum_logprob + lp.logprob, beam, token))
            candidates.sort(key=lambda c: -c[0])
            nxt = []
            for cum, beam, token in candidates[:2 * k]:
                seq = BeamSequence(beam.tokens + [token], cum)
                if token in eos and not params.ignore_eos:
                    seq.finished = True
                    finished.append(seq)
                elif token in eos:
                    continue          # ignore_eos: an EOS never extends a beam
                else:
                    nxt.append(seq)
                if len(nxt) == k:
                    break
            running = nxt
            if not running:
                break
        pool = finished + running
        pool.sort(key=lambda b: -b.score(params.length_penalty))
        best = pool[:k]
        for b in best:
            b.text = tok.decode(b.tokens, skip_special_tokens=True)
        results.append(BeamSearchOutput(list(ids), best))
    return results
