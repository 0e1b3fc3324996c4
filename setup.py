"""The package list, derived from the tree (setuptools reads the rest from pyproject.toml).

A hand-kept `packages = [...]` in pyproject.toml fell behind the tree (jaxserve.lora,
jaxserve.tool_parsers and jaxserve.reasoning_parsers were missing, so a wheel could not be
imported). `sched/` and `checkpoints/` are top-level folders that install as `jaxserve.sched` and
`jaxserve.checkpoints` (pyproject.toml's package-dir), so `find_packages` alone cannot name them.
"""

from setuptools import find_packages, setup

# top-level folders that ship under their own names, and those that ship inside jaxserve
OWN_NAME = ("jaxserve", "pallas_kernels", "cpu_kernels")
INSIDE_JAXSERVE = ("sched", "checkpoints")


def _tree(top: str) -> list[str]:
    return find_packages(include=[top, f"{top}.*"])


def package_list() -> list[str]:
    packages = [p for top in OWN_NAME for p in _tree(top)]
    packages += [f"jaxserve.{p}" for top in INSIDE_JAXSERVE for p in _tree(top)]
    return sorted(packages)


setup(packages=package_list())
