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

for _name, _folder in (("jaxserve.sched", "sched"), ("jaxserve.checkpoints", "checkpoints")):
    if _name not in sys.modules and importlib.util.find_spec("jaxserve") is not None:
        try:
            importlib.import_module(_name)
        except ModuleNotFoundError:
            _spec = importlib.util.spec_from_file_location(
                _name, os.path.join(_ROOT, _folder, "__init__.py"),
                submodule_search_locations=[os.path.join(_ROOT, _folder)],
            )
            _mod = importlib.util.module_from_spec(_spec)
            sys.modules[_name] = _mod
            _spec.loader.exec_module(_mod)
