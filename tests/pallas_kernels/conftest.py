"""Helpers importable by name, and the full kernel grid kept out of default runs.

`-m full_grid` (or any -m expression naming it) runs the whole grid; without it those tests are
skipped, so CI runs only the pairwise subset whatever its -m.
"""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)   # pallas_kernel_cases, pallas_cross_lower


def pytest_collection_modifyitems(config, items):
    if "full_grid" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="full kernel grid: run with -m full_grid")
    for item in items:
        if "full_grid" in item.keywords:
            item.add_marker(skip)
