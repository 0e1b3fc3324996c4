"""The embedded SmolLM2's shipped chat template (jaxserve/engine/templates/smollm2_tools.jinja):
without tools it renders exactly what the checkpoint's own renders, so nothing else changes; with
tools it lists them and asks for Hermes-style calls, the hermes parser is chosen for it, and a
multi-turn exchange renders calls and results back. Slow: on the embedded model itself, tools with
tool_choice="required" give a valid call with no flag."""

import json

import jsonschema
import pytest

from jaxserve.engine.chat_template import EMBEDDED_TOOLS_TEMPLATE, default_chat_template, load_chat_template
from jaxserve.tool_parsers import default_tool_parser, template_takes_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}}]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Tides?"}],
]


@pytest.fixture(scope="module")
def checkpoint():
    from jaxserve.checkpoints import load_checkpoint

    return load_checkpoint(None)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_it_renders_what_the_checkpoints_template_renders(checkpoint, conversation, generation_prompt):
    tok = checkpoint.tokenizer
    own = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
    shipped = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt,
                                      chat_template=load_chat_template(EMBEDDED_TOOLS_TEMPLATE))
    assert shipped == own


def test_it_is_the_embedded_models_default_and_renders_tools_for_the_hermes_parser(checkpoint, tmp_path):
    assert default_chat_template(checkpoint.source, None) == EMBEDDED_TOOLS_TEMPLATE
    assert default_chat_template(checkpoint.source, "mine.jinja") == "mine.jinja"     # a configured one wins
    assert default_chat_template(str(tmp_path / "other.gguf"), None) is None          # other models keep theirs
    assert not template_takes_tools(checkpoint.tokenizer.chat_template)               # why it is shipped
    template = load_chat_template(EMBEDDED_TOOLS_TEMPLATE)
    assert template_takes_tools(template) and default_tool_parser("llama", template) == "hermes"
    text = checkpoint.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        tokenize=False, add_generation_prompt=True, chat_template=template, tools=TOOLS)
    assert json.dumps(TOOLS[0]) in text and "<tool_call>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow   # the embedded model compiled (~1-2 min on 2 cores)
def test_the_embedded_model_calls_a_tool_with_no_flag():
    from jaxserve import LLM, SamplingParams

    llm = LLM(None, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=1024, num_kv_blocks=96,
              compilation_cache_dir="", progress=False)
    out = llm.chat([{"role": "user", "content": "What is the weather in Paris?"}],
                   SamplingParams(max_tokens=64, temperature=0.0), tools=TOOLS, tool_choice="required",
                   use_tqdm=False)[0].outputs[0]
    calls = out.message.tool_calls
    assert calls and calls[0].name == "get_weather", out.text
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
