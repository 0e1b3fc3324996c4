"""Structured output on the tiny random model: whatever the model would say, every output parses
and validates against its JSON schema (nested objects, arrays, enums, required fields), under
greedy and temperature 1, with n > 1; a regex and a choice list hold; a request whose grammar
reaches its end finishes with "stop"; a request without a grammar keeps its tokens beside one
with it; a bad schema or regex is refused at the door; nothing compiles after warm-up."""

import json
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.structured_outputs import StructuredOutputs
from tests.conftest import TINY_ENGINE

PROMPT = "The tide comes in"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "kind": {"enum": ["tide", "wave", "moon"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": 0, "maximum": 90},
                                                   "sea": {"enum": ["north", "red"]}},
                  "required": ["lat", "sea"], "additionalProperties": False},
    },
    "required": ["name", "kind", "ok", "tags", "where"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, **TINY_ENGINE)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_json_schema(llm, temperature):
    # the longest output that matches is about 100 tokens of this byte-level vocabulary
    params = SamplingParams(n=3, max_tokens=112, temperature=temperature, seed=5,
                            structured_outputs=StructuredOutputs(json=SCHEMA))
    outs = llm.generate([PROMPT, "def add(a, b):"], params, use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_json_object_regex_and_choice(llm):
    specs = [StructuredOutputs(json_object=True), StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"),
             StructuredOutputs(choice=("yes", "no", "maybe")), StructuredOutputs(grammar='start: "ab" "c"+ "!"')]
    outs = llm.generate([PROMPT] * 4, [SamplingParams(max_tokens=60, temperature=1.0, seed=2, structured_outputs=s)
                                       for s in specs], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[1]), texts[1]
    assert texts[2] in ("yes", "no", "maybe")
    assert re.fullmatch(r"abc+!", texts[3]), texts[3]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_without_a_grammar_keeps_its_tokens_beside_one_with_it(llm, async_scheduling):
    engine_llm = llm if async_scheduling else LLM.sharing_runner(llm, async_scheduling=False)
    plain = SamplingParams(max_tokens=20, temperature=1.0, seed=9, ignore_eos=True)
    alone = engine_llm.generate(PROMPT, plain, use_tqdm=False)[0].outputs[0].token_ids
    both = engine_llm.generate([PROMPT, PROMPT], [plain, SamplingParams(
        max_tokens=20, structured_outputs=StructuredOutputs(regex="[a-z ]{1,30}"))], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone
    assert re.fullmatch("[a-z ]{1,30}", both[1].outputs[0].text)


@pytest.mark.parametrize("spec, words", [
    (dict(json={"type": "wat"}), "does not compile"),
    (dict(regex="(("), "does not compile"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="a", choice=["b"]), "exactly one"),
])
def test_a_bad_spec_is_refused_at_the_door(llm, spec, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(PROMPT, SamplingParams(structured_outputs=spec), use_tqdm=False)


def test_a_failing_grammar_matcher_ends_the_sample_with_its_error_as_the_stop_reason(llm, monkeypatch):
    """llguidance can refuse a token its own mask allowed (a grammar literal spelled like an added
    token); the sample then ends, but saying why, not as if its grammar had completed. The fault is
    injected: after the first real token the matcher is fed a token its grammar cannot take."""
    from jaxserve.runner.token_mask import TokenConstraint

    grammars = llm.engine.input_processor.grammars
    real = grammars.constraint

    class FailingAfterOne(TokenConstraint):
        __slots__ = ()

        def consume(self, token_ids):
            super().consume(token_ids)
            if self.consumed >= 1 and not self.matcher.is_error():
                bad = next(t for t in range(llm.engine.runner.model_config.vocab_size)
                           if not self.matcher.validate_tokens([t]))
                self.matcher.consume_token(bad)

    monkeypatch.setattr(grammars, "constraint", lambda g: FailingAfterOne(real(g).matcher))
    out = llm.generate(["Say it:"], SamplingParams(max_tokens=16, temperature=0,
                                                   structured_outputs=StructuredOutputs(regex="[a-z]{12}")),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert isinstance(out.stop_reason, str) and out.stop_reason.startswith("grammar error: "), out.stop_reason
    assert len(out.token_ids) == 1
    monkeypatch.undo()
    ok = llm.generate(["Say it:"], SamplingParams(max_tokens=16, temperature=0,
                                                  structured_outputs=StructuredOutputs(regex="[a-z]{12}")),
                      use_tqdm=False)[0].outputs[0]
    assert ok.stop_reason is None and re.fullmatch("[a-z]{12}", ok.text)
