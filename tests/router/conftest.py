"""Fixtures of the router tests: two gated tiny-model replicas shared by the module (started
together; the first compile fills the compilation cache of the second start)."""

import pytest


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla-cache"))
