"""Root conftest: lets the tests import the mapped packages from a plain checkout.

With the editable install (`pip install -e .`) this is redundant; without it, `jaxserve.sched` and
`jaxserve.checkpoints` are mapped onto the top-level folders exactly as setuptools maps them.
"""

import importlib.util
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_ROOT = os.path.dirname(os.path.abspath(__file__))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)  # appended, not prepended: the folder sched/ must not shadow stdlib sched

if importlib.util.find_spec("jaxserve") is not None:
    from jaxserve.bench.run_from_checkout import map_packages

    map_packages(_ROOT)
