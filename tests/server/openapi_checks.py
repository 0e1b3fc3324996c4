"""Schemathesis hooks of the OpenAPI conformance run (tests/server/test_openapi_conformance.py).

One check replaces schemathesis' `positive_data_acceptance`: a request valid by the document must
be accepted, except for a 400 whose `error.code` names a refusal no JSON Schema can express
(jaxserve/server/http/openapi.py REFUSAL_CODES: a prompt and max_tokens that together pass
max_model_len, fields valid alone refused together, a grammar that does not compile, a template
that refuses the conversation). Any other 4xx for a valid request still fails the run.
"""

import json

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

from jaxserve.server.http.openapi import REFUSAL_CODES


@schemathesis.check
def positive_data_acceptance_but_refusals_no_schema_expresses(ctx, response, case):
    if response.status_code == 400:
        try:
            code = json.loads(response.content)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if code in REFUSAL_CODES:
            return True
    return positive_data_acceptance(ctx, response, case)


@schemathesis.check
def no_traceback_in_an_answer(ctx, response, case):
    """A bug is logged with its traceback and answered in OpenAI's error shape, never with the traceback."""
    if b"Traceback (most recent call last)" in response.content:
        raise AssertionError(f"a traceback in the {response.status_code} answer")
    return None
