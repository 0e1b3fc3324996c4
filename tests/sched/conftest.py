"""Makes tests/sched/sched_testkit.py importable (pytest runs with --import-mode=importlib)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.append(_HERE)
