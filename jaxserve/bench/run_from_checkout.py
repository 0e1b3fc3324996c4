"""Run a module of this source tree with a Python that has the dependencies but not jaxserve.

`pip install -e .` maps the packages `jaxserve.sched` and `jaxserve.checkpoints` onto the
top-level folders sched/ and checkpoints/ (pyproject.toml's package-dir). A machine image with
jax, torch and transformers but without our install (a GPU machine) lacks that mapping, so
`python -m jaxserve.cli` fails there at the first engine import. This module makes the same
mapping (as the root conftest.py does for the tests), then runs the module as __main__:

    cd REPO && python3 -m jaxserve.bench.run_from_checkout jaxserve.cli bench latency ...

With the editable install the mapping already exists and nothing is changed. The checkout is
kept at the end of sys.path, not the front, so the folder sched/ cannot shadow the standard
library's `sched` module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAPPED = (("jaxserve.sched", "sched"), ("jaxserve.checkpoints", "checkpoints"))


def map_packages(root: str = ROOT) -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != root] + [root]
    for name, folder in MAPPED:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            spec = importlib.util.spec_from_file_location(
                name, os.path.join(root, folder, "__init__.py"),
                submodule_search_locations=[os.path.join(root, folder)])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            parent, _, child = name.rpartition(".")
            setattr(importlib.import_module(parent), child, module)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    map_packages()
    module, sys.argv = argv[0], argv
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
