"""Helpers importable by name. The full kernel grid (`full_grid`) is kept out of default runs by
tests/conftest.py: `-m full_grid` runs it, so CI runs only the pairwise subset."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)   # pallas_kernel_cases, pallas_cross_lower
