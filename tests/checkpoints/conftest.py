"""Fixtures for the checkpoint tests; makes ckpt_testkit.py importable (--import-mode=importlib)."""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)


@pytest.fixture(scope="session")
def embedded_path() -> str:
    from jaxserve.checkpoints import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def embedded(embedded_path):
    """The embedded SmolLM2, loaded once for the whole session (about 10 s)."""
    from jaxserve.checkpoints import load_checkpoint

    return load_checkpoint(None)
