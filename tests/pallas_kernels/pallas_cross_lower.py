"""Lowers a function for CUDA on a machine without a GPU, so GPU-only shape rules fail in CI.

jax 0.11.2 needs an abstract mesh naming a CUDA device to lower for "cuda" here; the kernels'
custom calls are not on export's stable list, so their safety checks are disabled by name.
"""

from __future__ import annotations

import jax
from jax.sharding import AbstractDevice, AbstractMesh

KERNEL_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu", "mosaic_gpu_v2")


def export_for_cuda(fn, *args, device_kind: str = "NVIDIA H200"):
    """jax.export of jit(fn) for platforms=["cuda"]; returns the Exported (its mlir_module() is the text)."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind, None, "cuda"))
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in KERNEL_CUSTOM_CALLS]
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
