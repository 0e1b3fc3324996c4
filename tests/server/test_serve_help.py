"""`jaxserve serve --help` and `jaxserve client --help` state each default once."""

import re

import pytest

from jaxserve.cli import build_parser

TWO_DEFAULTS = re.compile(r"\(default:[^()]*\)\s*\(default:")


@pytest.mark.parametrize("command", ["serve", "client"])
def test_help_states_each_default_once(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())     # the help as one line: wrapping aside
    assert not TWO_DEFAULTS.findall(text), TWO_DEFAULTS.findall(text)
    assert "(default: None)" not in text
    assert "--target TARGET host:port of the server (default: 127.0.0.1:50051)" in text or command == "serve"
    if command == "serve":
        assert "--port PORT gRPC port (0: pick a free one) (default: 50051)" in text
        assert "--max-num-seqs MAX_NUM_SEQS" in text and "(default: $JAXSERVE_API_KEY)" in text
