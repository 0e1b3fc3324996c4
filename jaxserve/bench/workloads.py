"""Seeded, reproducible benchmark workloads: token ids, output lengths and send times.

Every backend of a run receives the same `Workload`: the same prompt token ids (tokenized once,
here) and the same exact output lengths (generation ignores EOS), so numbers compare like with
like. Workloads:

- `random` (vLLM's semantics): input and output lengths drawn uniformly from integer ranges;
  each prompt is a window of real text (corpus.py) starting at a random token offset.
- `shared-prefix` (SGLang's generated-shared-prefix semantics): `num_groups` system prompts of
  `system_prompt_len` tokens, each followed by `prompts_per_group` distinct questions of
  `question_len` tokens; all prompts are shuffled together.
- `sharegpt` (vLLM's semantics): first human turn as prompt, the reply's token count as output
  length, from a local JSON file in ShareGPT format; too short or too long pairs are dropped.
- `interference`: short chats sent at once, and long prompts sent while the chats decode: their
  offsets count from the moment every chat has its first token (`after_group="chat"`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from jaxserve.bench.arrivals import arrival_offsets
from jaxserve.bench.corpus import PARAGRAPHS, corpus_text


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_len: int                    # exact number of tokens to generate (EOS ignored)
    arrival_offset: float = 0.0        # seconds after the start of the run (or of after_group)
    group: str = ""                    # label reported with the request's timings
    after_group: str | None = None     # offset counts from when this group all has a first token
    temperature: float = 0.0           # 0: greedy (every backend); > 0: sampled, seeded by the request's index

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"prompt_token_ids of {self.request_id} must not be empty")
        if self.output_len < 1:
            raise ValueError(f"output_len of {self.request_id} must be >= 1, got {self.output_len}")
        if self.arrival_offset < 0:
            raise ValueError(f"arrival_offset of {self.request_id} must be >= 0, got {self.arrival_offset}")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    params: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": self.params,
            "num_requests": len(self.requests),
            "total_prompt_tokens": sum(len(r.prompt_token_ids) for r in self.requests),
            "total_output_tokens": sum(r.output_len for r in self.requests),
            "max_prompt_len": max((len(r.prompt_token_ids) for r in self.requests), default=0),
            "max_seq_len": max((len(r.prompt_token_ids) + r.output_len for r in self.requests), default=0),
        }


@dataclass(frozen=True, slots=True)
class LengthRange:
    """An inclusive integer range [low, high] sampled uniformly."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"length range must satisfy 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str | int, range_ratio: float = 0.0) -> "LengthRange":
        """'LOW:HIGH', or 'N' widened by range_ratio as vLLM does: [N*(1-r), N*(1+r)]."""
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
        s = str(text)
        if ":" in s:
            low, high = s.split(":", 1)
            return cls(int(low), int(high))
        n = int(s)
        return cls(max(1, int(n * (1 - range_ratio))), int(n * (1 + range_ratio)))

    def sample(self, rng: np.random.Generator, size: int) -> list[int]:
        return rng.integers(self.low, self.high + 1, size=size).tolist()

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids without special tokens, for a transformers or a `tokenizers` tokenizer."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))


class TokenSource:
    """The corpus tokenized once; prompts are windows of it (wrapping around at the end)."""

    def __init__(self, tokenizer: Any, text: str | None = None) -> None:
        self.tokens = np.asarray(encode(tokenizer, text or corpus_text()), dtype=np.int64)  # [corpus_len]
        if self.tokens.size < 2:
            raise ValueError("the corpus tokenized to fewer than 2 tokens")

    def window(self, rng: np.random.Generator, length: int) -> tuple[int, ...]:
        start = int(rng.integers(0, self.tokens.size))
        idx = (start + np.arange(length)) % self.tokens.size
        return tuple(int(t) for t in self.tokens[idx])


def random_workload(
    tokenizer: Any, num_prompts: int, input_len: LengthRange, output_len: LengthRange, seed: int = 0,
) -> Workload:
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    src = TokenSource(tokenizer)
    ins, outs = input_len.sample(rng, num_prompts), output_len.sample(rng, num_prompts)
    reqs = tuple(
        BenchRequest(f"random-{i}", src.window(rng, n_in), n_out)
        for i, (n_in, n_out) in enumerate(zip(ins, outs))
    )
    return Workload("random", reqs, {
        "num_prompts": num_prompts, "input_len": str(input_len), "output_len": str(output_len), "seed": seed,
    })


EDIT_INSTRUCTION = "Correct the spelling mistakes in the text below and write out the whole corrected text:\n\n"


def _with_typos(text: str, rng: np.random.Generator, share: float = 0.08) -> str:
    """Swap two neighbouring letters in about `share` of the longer words."""
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 4 and w.isalpha() and rng.random() < share:
            j = int(rng.integers(1, len(w) - 2))
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def chat_prompt(tokenizer: Any, content: str) -> list[int]:
    """The user message in the model's chat template (an instruct model's prompt), or the plain
    text for a tokenizer without one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=True)
        return list(getattr(ids, "input_ids", ids))
    return encode(tokenizer, content)


def edit_workload(tokenizer: Any, num_prompts: int, output_len: LengthRange | None = None, seed: int = 0,
                  paragraphs: int = 2) -> Workload:
    """A repetitive workload, as editing or summarising a given text is: each prompt asks the
    model to correct the typos of a few corpus paragraphs and write the text out again, so most of
    the answer copies the prompt. Output length: the text's own token count (or `output_len`)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(num_prompts):
        picks = rng.choice(len(PARAGRAPHS), size=min(paragraphs, len(PARAGRAPHS)), replace=False)
        text = "\n\n".join(PARAGRAPHS[int(k)] for k in picks)
        prompt = chat_prompt(tokenizer, EDIT_INSTRUCTION + _with_typos(text, rng))
        n_out = output_len.sample(rng, 1)[0] if output_len is not None else len(encode(tokenizer, text))
        reqs.append(BenchRequest(f"edit-{i}", tuple(prompt), int(n_out)))
    return Workload("edit", tuple(reqs), {"num_prompts": num_prompts, "paragraphs": paragraphs, "seed": seed,
                                          "output_len": str(output_len) if output_len else "the text's length"})


def with_temperature(workload: Workload, temperature: float) -> Workload:
    """The same requests, sampled at `temperature` (0: greedy)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not temperature:
        return workload
    return Workload(workload.name, tuple(replace(r, temperature=temperature) for r in workload.requests),
                    {**workload.params, "temperature": temperature})


def shared_prefix_workload(
    tokenizer: Any, num_groups: int = 8, prompts_per_group: int = 8, system_prompt_len: int = 1024,
    question_len: int = 64, output_len: int = 64, seed: int = 0,
) -> Workload:
    for name, v in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group),
                    ("system_prompt_len", system_prompt_len), ("question_len", question_len),
                    ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    rng = np.random.default_rng(seed)
    src = TokenSource(tokenizer)
    reqs = []
    for g in range(num_groups):
        system = src.window(rng, system_prompt_len)
        for p in range(prompts_per_group):
            reqs.append(BenchRequest(f"prefix-g{g}-p{p}", system + src.window(rng, question_len),
                                     output_len, group=f"g{g}"))
    order = rng.permutation(len(reqs))
    return Workload("shared-prefix", tuple(reqs[i] for i in order), {
        "num_groups": num_groups, "prompts_per_group": prompts_per_group,
        "system_prompt_len": system_prompt_len, "question_len": question_len,
        "output_len": output_len, "seed": seed,
    })


def sharegpt_workload(
    tokenizer: Any, path: str | os.PathLike, num_prompts: int, seed: int = 0,
    output_len: int | None = None, max_prompt_len: int = 1024, max_total_len: int = 2048,
) -> Workload:
    """Conversations with at least two turns; pairs shorter than 4 tokens or longer than the caps go."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    convs = [d["conversations"] for d in data if isinstance(d, dict) and len(d.get("conversations", ())) >= 2]
    rng = np.random.default_rng(seed)
    reqs: list[BenchRequest] = []
    for i in rng.permutation(len(convs)):
        if len(reqs) == num_prompts:
            break
        prompt = encode(tokenizer, convs[i][0]["value"])
        n_out = output_len if output_len is not None else len(encode(tokenizer, convs[i][1]["value"]))
        if len(prompt) < 4 or n_out < 4 or len(prompt) > max_prompt_len or len(prompt) + n_out > max_total_len:
            continue
        reqs.append(BenchRequest(f"sharegpt-{len(reqs)}", tuple(prompt), n_out))
    if len(reqs) < num_prompts:
        raise ValueError(f"{path}: only {len(reqs)} usable conversations, {num_prompts} requested")
    return Workload("sharegpt", tuple(reqs), {
        "path": os.fspath(path), "num_prompts": num_prompts, "seed": seed, "output_len": output_len,
    })


def interference_workload(
    tokenizer: Any, num_chats: int = 16, chat_prompt_len: int = 64, chat_output_len: int = 128,
    num_long: int = 4, long_prompt_len: int = 4096, long_output_len: int = 8,
    long_interval: float = 0.5, seed: int = 0,
) -> Workload:
    """Chats sent at 0; long prompt i sent i * long_interval after every chat has its first token."""
    if num_chats < 1 or num_long < 0:
        raise ValueError(f"need num_chats >= 1 and num_long >= 0, got {num_chats}, {num_long}")
    rng = np.random.default_rng(seed)
    src = TokenSource(tokenizer)
    reqs = [BenchRequest(f"chat-{i}", src.window(rng, chat_prompt_len), chat_output_len, group="chat")
            for i in range(num_chats)]
    reqs += [BenchRequest(f"long-{j}", src.window(rng, long_prompt_len), long_output_len,
                          arrival_offset=j * long_interval, group="long", after_group="chat")
             for j in range(num_long)]
    return Workload("interference", tuple(reqs), {
        "num_chats": num_chats, "chat_prompt_len": chat_prompt_len, "chat_output_len": chat_output_len,
        "num_long": num_long, "long_prompt_len": long_prompt_len, "long_output_len": long_output_len,
        "long_interval": long_interval, "seed": seed,
    })


def with_arrivals(workload: Workload, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> Workload:
    """The same requests with send offsets from arrivals.py (workloads without after_group only)."""
    if any(r.after_group for r in workload.requests):
        raise ValueError(f"workload {workload.name} sets its own arrival times")
    offsets = arrival_offsets(len(workload.requests), request_rate, burstiness, seed)
    reqs = tuple(replace(r, arrival_offset=o) for r, o in zip(workload.requests, offsets))
    params = {**workload.params, "request_rate": request_rate if math.isfinite(request_rate) else "inf",
              "burstiness": burstiness}
    return Workload(workload.name, reqs, params)


def at_once(r: BenchRequest) -> BenchRequest:
    """The request sent at the start of the run, whatever its offset."""
    return replace(r, arrival_offset=0.0, after_group=None)


def warmup_requests(workload: Workload, num_warmup: int) -> tuple[BenchRequest, ...]:
    """Requests shaped like the first ones, sent at once before the timed run and not timed.

    Their prompts are the originals reversed: same lengths, but no shared prefix, so a prefix
    cache is not primed with the timed requests' prompts.
    """
    if num_warmup < 0:
        raise ValueError(f"num_warmup must be >= 0, got {num_warmup}")
    return tuple(replace(r, request_id=f"warmup-{r.request_id}", prompt_token_ids=r.prompt_token_ids[::-1],
                         arrival_offset=0.0, after_group=None)
                 for r in workload.requests[:num_warmup])
