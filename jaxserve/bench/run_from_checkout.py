"""Run a module of this source tree with a Python that has the dependencies but not jaxserve.

`pip install -e .` maps the packages `jaxserve.sched` and `jaxserve.checkpoints` onto the
top-level folders sched/ and checkpoints/ (pyproject.toml's package-dir). A machine image with
jax, torch and transformers but without our install (a GPU machine) lacks that mapping, so
`python -m jaxserve.cli` fails there at the first engine import. This module makes the same
mapping (as the root conftest.py does for the tests), then runs the module as __main__:

    cd REPO && python3 -m jaxserve.bench.run_from_checkout jaxserve.cli bench latency ...

With the editable install of this checkout the mapping already exists and nothing is changed; an
editable install of another checkout maps `jaxserve.sched` onto *its* folder, so a package that
resolves outside the checkout is loaded from the checkout's folder instead. The checkout is kept
at the end of sys.path, not the front, so the folder sched/ cannot shadow the standard library's
`sched` module.

`--checkout DIR` runs an older checkout's code with this one's launcher (a before/after benchmark
on one machine and one environment, the older tree lacking this fix): every jaxserve package is
imported from DIR, none from the install.

    python3 -m jaxserve.bench.run_from_checkout --checkout /tmp/before jaxserve.cli bench host ...
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
        if name in sys.modules and _inside(sys.modules[name], root):
            continue
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is not None and _inside(found, root):
            importlib.import_module(name)
        else:     # not installed, or another checkout's folder: this checkout's
            spec = importlib.util.spec_from_file_location(
                name, os.path.join(root, folder, "__init__.py"),
                submodule_search_locations=[os.path.join(root, folder)])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            parent, _, child = name.rpartition(".")
            setattr(importlib.import_module(parent), child, module)


def _inside(module_or_spec, root: str) -> bool:
    origin = getattr(module_or_spec, "origin", None) or getattr(module_or_spec, "__file__", None) or ""
    return os.path.abspath(origin).startswith(os.path.abspath(root) + os.sep)


TOP_LEVEL = ("jaxserve", "cpu_kernels", "pallas_kernels")


def use_checkout(root: str) -> None:
    """Import every jaxserve package from `root` from now on: the editable install's finders are
    dropped and the packages already imported (this launcher's own) forgotten."""
    root = os.path.abspath(root)
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in str(getattr(f, "__module__", ""))]
    sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in str(getattr(h, "__module__", ""))]
    sys.path_importer_cache.clear()
    for name in [m for m in sys.modules if m.split(".")[0] in TOP_LEVEL]:
        del sys.modules[name]
    # no other checkout on the path (the working directory may be one); this one last, as
    # map_packages keeps it (its folder sched/ must not shadow the standard library's)
    sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or ".", "jaxserve", "__init__.py"))]
    sys.path.append(root)
    importlib.invalidate_caches()
    module = importlib.import_module("jaxserve.bench.run_from_checkout")   # the checkout's own
    module.map_packages(root)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    if argv[0] == "--checkout":
        if len(argv) < 3:
            raise SystemExit("run_from_checkout: --checkout DIR MODULE [ARGS...]")
        root, argv = argv[1], argv[2:]
        use_checkout(root)
        # the checkout's map_packages may be the old one (another checkout's folders kept): check
        for name, folder in MAPPED:
            if not _inside(importlib.import_module(name), root):
                raise SystemExit(f"run_from_checkout: {name} resolved outside {root}")
    else:
        map_packages()
    module, sys.argv = argv[0], argv
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
