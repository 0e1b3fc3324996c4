"""Import every module a jaxserve wheel ships, from the installed wheel, not from a checkout.

Run by scripts/check_wheel.sh with the clean venv's interpreter, from a folder outside the
checkout. Fails (exit 1) if a module cannot be imported, if a module resolves outside the venv
(a checkout on sys.path would hide a missing package), or if a folder of the tree that holds
Python code is missing from the wheel.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import sysconfig
import traceback

# The installed top-level packages: jaxserve (with jaxserve.sched and jaxserve.checkpoints
# inside it) and the two kernel packages.
TOP_LEVEL = ("jaxserve", "pallas_kernels", "cpu_kernels")

def main(checkout: str) -> int:
    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    failures: list[str] = []
    imported = 0
    for top in TOP_LEVEL:
        package = importlib.import_module(top)
        names = [top] + [m.name for m in pkgutil.walk_packages(package.__path__, prefix=f"{top}.")]
        for name in names:
            try:
                module = importlib.import_module(name)
            except Exception:
                failures.append(f"{name}: cannot be imported\n{traceback.format_exc(limit=3)}")
                continue
            where = os.path.realpath(getattr(module, "__file__", "") or "")
            if not where.startswith(site):
                failures.append(f"{name}: resolves to {where}, outside the venv's {site}")
            imported += 1
    failures += _missing_folders(checkout, site)
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    print(f"imported {imported} modules from the wheel; {len(failures)} failures")
    return 1 if failures else 0


def _missing_folders(checkout: str, site: str) -> list[str]:
    """Every folder of the tree's packages that holds Python code is installed (the check that
    would have caught jaxserve.lora's absence even before anything imported it)."""
    installed_as = {"jaxserve": "jaxserve", "pallas_kernels": "pallas_kernels", "cpu_kernels": "cpu_kernels",
                    "sched": "jaxserve/sched", "checkpoints": "jaxserve/checkpoints"}
    missing = []
    for src, dst in installed_as.items():
        for folder, _dirs, files in os.walk(os.path.join(checkout, src)):
            if "__pycache__" in folder or not any(f.endswith(".py") for f in files):
                continue
            rel = os.path.relpath(folder, os.path.join(checkout, src))
            target = os.path.normpath(os.path.join(site, dst, rel))
            if not os.path.isdir(target):
                missing.append(f"{os.path.relpath(folder, checkout)}: not in the wheel (expected at {target})")
    return missing


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
