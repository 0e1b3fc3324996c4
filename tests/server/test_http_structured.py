"""Structured output over the HTTP API with the openai client: response_format json_schema and
json_object, vLLM's structured_outputs (regex, choice), streamed and not, n > 1; every output
validates against its schema (jsonschema); a bad schema is a 400 naming the field."""

import json
import re

import jsonschema
import openai
import pytest

from tests.server.http_harness import serving

SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["tide", "wave"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["kind", "n", "tags"], "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "The tide comes in"}]


server, client = serving()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_format_validates_streamed_and_not(server, client, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=60, n=2, seed=1,
                                       temperature=temperature, response_format=fmt)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=60, temperature=temperature, seed=1, stream=True,
        response_format=fmt) if ch.choices)
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_json_object_regex_and_choice(server, client):
    obj = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=60,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    rx = client.completions.create(model=server.model, prompt="x", max_tokens=20, temperature=1.0,
                                   extra_body={"structured_outputs": {"regex": "[0-9]{2}-[ab]{2}"}})
    assert re.fullmatch("[0-9]{2}-[ab]{2}", rx.choices[0].text)
    ch = client.completions.create(model=server.model, prompt="x", max_tokens=20,
                                   extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert ch.choices[0].text in ("red", "green") and ch.choices[0].finish_reason == "stop"


def test_a_bad_schema_is_a_400_naming_the_field(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "wat"}}})
    err = e.value.response.json()["error"]
    assert err["param"] == "response_format" and "wat" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", extra_body={"structured_outputs": {"regex": "(("}})
    assert e.value.response.json()["error"]["param"] == "structured_outputs"
