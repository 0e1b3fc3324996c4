"""What start-up results depend on beyond their own inputs: the machine, the software, the code.

A serialized executable holds machine code for the CPU (or GPU) it was compiled on, and a
measured rate is a property of the machine that measured it; both caches key their entries by
`machine()`. An executable is also the product of the code that traced it: `traced_source()`
hashes the packages whose Python is traced into a step or sampler (so an edit there compiles
again; an edit elsewhere, say the server, does not).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform

# Packages whose code runs inside the traced step and sampler functions (or shapes their inputs),
# less the runner's start-up modules, which never run inside a trace: editing them (or this file)
# must not throw away every cached executable.
TRACED_PACKAGES = ("jaxserve.models", "jaxserve.parallel", "jaxserve.runner", "jaxserve.sched", "pallas_kernels",
                   "cpu_kernels")
TRACED_MODULES = ("jaxserve.sampling_params",)
UNTRACED_MODULES = ("background_warmup", "calibration", "compile_counter", "executables", "fingerprint", "scratch",
                    "warm_plan", "warmup")
VERSIONED_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")


@functools.cache
def machine() -> dict:
    """The device and host facts an executable or a timing is only valid for."""
    import jax

    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "platform_version": device.client.platform_version,
        "num_devices": jax.device_count(),
        "cpu": cpu_model(),
        "cpu_flags": hashlib.sha256(cpu_flags().encode()).hexdigest()[:16],
        "cpu_count": os.cpu_count(),
        "arch": platform.machine(),
    }


@functools.cache
def software() -> dict:
    """Versions of what compiles and runs the steps, and the settings that change the compiled code."""
    import jax

    versions = {}
    for name in VERSIONED_DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "versions": versions,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "x64": bool(jax.config.jax_enable_x64),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
    }


@functools.cache
def traced_source() -> str:
    """sha256 over the source (Python, and the C++ of cpu_kernels/) of TRACED_PACKAGES and TRACED_MODULES."""
    import importlib.util

    files = []
    runner = importlib.util.find_spec("jaxserve.runner").submodule_search_locations
    untraced = {os.path.join(folder, f"{name}.py") for folder in runner for name in UNTRACED_MODULES}
    for name in TRACED_PACKAGES:
        spec = importlib.util.find_spec(name)
        for folder in spec.submodule_search_locations or ():
            for root, dirs, names in os.walk(folder):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                files += [os.path.join(root, n) for n in sorted(names)
                          if n.endswith((".py", ".cc")) and os.path.join(root, n) not in untraced]
    files += [importlib.util.find_spec(name).origin for name in TRACED_MODULES]
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> str:
    # the instruction set extensions XLA:CPU may have compiled for (AVX-512, AMX, ...)
    return _cpuinfo_field("flags")
