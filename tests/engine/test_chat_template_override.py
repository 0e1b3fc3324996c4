"""EngineConfig.chat_template (`--chat-template`): a template of the operator's replaces the
checkpoint's, checked before anything loads; with one that renders tools, a model whose own
template renders none (the tiny Llama's, like the embedded SmolLM2's) can be given tools."""

import json

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine_args import engine_config
from tests.conftest import TINY_ENGINE

TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}. <tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_tide", "description": "tide height",
                                         "parameters": {"type": "object", "properties": {"port": {"type": "string", "maxLength": 6}},
                                                        "required": ["port"]}}}


def test_a_bad_template_fails_the_config_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor Jinja"):
        engine_config(chat_template="tools.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match="does not parse"):
        engine_config(chat_template=str(bad))


def test_the_template_file_replaces_the_models_and_lets_it_take_tools(tiny_llama_dir, tmp_path):
    from jaxserve.tool_parsers.plan import template_takes_tools


    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    llm = LLM(tiny_llama_dir, **{**TINY_ENGINE, "max_model_len": 256}, chat_template=str(path))
    tok = llm.get_tokenizer()
    assert tok.chat_template == TOOLS_TEMPLATE and template_takes_tools(tok.chat_template)
    out = llm.chat([{"role": "user", "content": "tide?"}], SamplingParams(max_tokens=120, temperature=0),
                   tools=[TOOL], tool_choice="required", parallel_tool_calls=False, use_tqdm=False)[0]
    rendered = tok.decode(out.prompt_token_ids)
    assert rendered.startswith("<|system|>Tools: get_tide.") and rendered.endswith("<|assistant|>")
    calls = out.outputs[0].message.tool_calls
    assert out.outputs[0].finish_reason == "stop", out.outputs[0].text      # the call ended the answer
    assert len(calls) == 1 and calls[0].name == "get_tide"
    assert isinstance(json.loads(calls[0].arguments)["port"], str)
