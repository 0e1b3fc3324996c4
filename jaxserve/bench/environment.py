"""Where a result was measured: versions, CPU, accelerator, git commit, host."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Any

_PACKAGES = ("jaxserve", "jax", "jaxlib", "flax", "numpy", "torch", "transformers", "tokenizers", "gguf", "vllm",
             "llama-cpp-python")


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _accelerators() -> list[str]:
    """Devices of the frameworks already imported (importing one just to ask would cost seconds)."""
    found = []
    if "jax" in sys.modules:
        try:
            found += [f"jax:{d.platform}:{getattr(d, 'device_kind', '?')}" for d in sys.modules["jax"].devices()]
        except Exception:  # a broken backend should not stop the report
            pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        found += [f"torch:cuda:{torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    return found


def environment() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "accelerators": _accelerators(),
        "packages": {p: v for p in _PACKAGES if (v := _version(p)) is not None},
        "git_commit": _git_commit(),
        "hostname": platform.node(),
    }
