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


def pytest_collection_modifyitems(config, items):
    # A `slow` test here (the full from_pretrained comparison, about a minute) runs only when asked
    # for with `-m slow`; the default run stays within this folder's time share.
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords and str(item.fspath).startswith(_HERE):
            item.add_marker(skip)
