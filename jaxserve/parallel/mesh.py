"""The device mesh: axes ("data", "model"), the model axis carrying tensor parallelism.

The "data" axis is size 1 today; it is named so that data-parallel replicas of the model can be
added later without renaming every PartitionSpec. Both axes are `AxisType.Auto`: the classic
GSPMD mode, where named shardings on the inputs (weights, KV arena) decide the program and XLA
inserts the collectives. `jax.make_mesh` now defaults to Explicit axes, under which every
einsum whose operands are sharded differently is a type error and a row-parallel matmul needs an
`out_sharding=`: the model would have to spell a sharding on every op, where Auto lets one
description per parameter (sharding.py) plus `shard_map` around attention do it.

A mixture-of-experts engine with expert_parallel_size > 1 runs on ("data", "expert", "model")
(`make_moe_mesh`): experts split over "expert", everything tensor parallelism splits over "model"
(parallel/experts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
MODEL_AXIS = "model"
AXES = (DATA_AXIS, MODEL_AXIS)
# a mixture-of-experts engine's mesh: experts split over "expert", attention heads (and each
# expert's intermediate columns) over "model" (parallel/experts.py)
EXPERT_AXIS = "expert"
MOE_AXES = (DATA_AXIS, EXPERT_AXIS, MODEL_AXIS)


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A (1, tensor_parallel_size) mesh over `devices` (default: every device of every process,
    in jax.devices() order, which groups each host's devices together)."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
                         f"{len(devices)} are visible ({devices[0].platform})")
    grid = np.array(devices[:tensor_parallel_size], dtype=object).reshape(1, tensor_parallel_size)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def make_moe_mesh(expert_parallel_size: int, tensor_parallel_size: int, devices=None) -> Mesh:
    """A (1, expert_parallel_size, tensor_parallel_size) mesh over the first EP x TP devices: each
    row of TP devices holds one expert shard and splits attention heads as tensor parallelism
    does (the rows each compute the whole attention: it is replicated over "expert")."""
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("expert_parallel_size", expert_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if size < 1:
            raise ValueError(f"{name}={size} must be >= 1")
    need = expert_parallel_size * tensor_parallel_size
    if need > len(devices):
        raise ValueError(f"expert_parallel_size={expert_parallel_size} x tensor_parallel_size={tensor_parallel_size} "
                         f"needs {need} devices; {len(devices)} are visible ({devices[0].platform})")
    grid = np.array(devices[:need], dtype=object).reshape(1, expert_parallel_size, tensor_parallel_size)
    return Mesh(grid, MOE_AXES, axis_types=(AxisType.Auto,) * 3)


def as_moe_mesh(mesh: Mesh) -> Mesh:
    """An engine's ("data" 1, "model" N) mesh as a MoE engine's, over the same devices in the same
    order, with an "expert" axis of size 1 (a caller's mesh: experts split only over "model")."""
    return Mesh(mesh.devices.reshape(1, 1, -1), MOE_AXES, axis_types=(AxisType.Auto,) * 3)


def engine_mesh(mesh: Mesh, axis: str | None = None) -> Mesh:
    """The engine's ("data" 1, "model" N) mesh over the devices of a mesh the caller owns
    (`LLM(mesh=...)`: an engine beside a trainer, on a sub-mesh of the process's devices).

    `axis` names the caller's tensor-parallel axis; by default "model" when the mesh has one, or
    the only axis of a 1-D mesh. Every other axis must have size 1: data-parallel replicas are
    not built, so a 2 x 2 trainer mesh is passed as the sub-mesh the engine should take (e.g.
    `Mesh(mesh.devices[0], ("model",))`). The devices keep the caller's order along the axis, and
    the result is a new Mesh with the engine's axis names and Auto axes (mesh.py's docstring):
    the caller's axis names and types never reach the engine's shardings."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh of concrete devices, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if axis is None:
        if MODEL_AXIS in names:
            axis = MODEL_AXIS
        elif len(names) == 1:
            axis = names[0]
        else:
            raise ValueError(f"mesh has axes {dict(mesh.shape)}: name its tensor-parallel axis with "
                             f"mesh_axis=... (or pass a 1-D mesh, or one with a {MODEL_AXIS!r} axis)")
    if axis not in names:
        raise ValueError(f"mesh_axis={axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    others = {name: size for name, size in mesh.shape.items() if name != axis and size != 1}
    if others:
        raise ValueError(f"mesh {dict(mesh.shape)}: the engine splits the model over {axis!r} only, and "
                         f"data-parallel replicas are not built, so every other axis must have size 1 "
                         f"(got {others}); pass the sub-mesh of the devices the engine should take")
    devices = np.moveaxis(mesh.devices, names.index(axis), -1).reshape(-1)
    here = jax.process_index()
    remote = [d for d in devices if d.process_index != here]
    if remote:
        raise ValueError(f"mesh holds devices of other processes ({remote[:3]}): an engine on a caller's mesh "
                         f"runs on one host (several hosts: --num-hosts)")
    return Mesh(np.array(list(devices), dtype=object).reshape(1, len(devices)), AXES,
                axis_types=(AxisType.Auto, AxisType.Auto))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@dataclass(frozen=True, slots=True)
class MeshInfo:
    """What stats() and GetServerInfo report about where the model runs."""

    num_devices: int                      # devices the model is split over
    num_hosts: int                        # processes those devices belong to
    axis_sizes: tuple[tuple[str, int], ...]   # (axis name, size), in mesh order
    device_kind: str

    @property
    def tensor_parallel_size(self) -> int:
        return dict(self.axis_sizes).get(MODEL_AXIS, 1)

    @property
    def expert_parallel_size(self) -> int:
        return dict(self.axis_sizes).get(EXPERT_AXIS, 1)

    def as_dict(self) -> dict:
        return {"num_devices": self.num_devices, "num_hosts": self.num_hosts,
                "axis_sizes": dict(self.axis_sizes), "device_kind": self.device_kind}


def describe(mesh: Mesh | None) -> MeshInfo:
    """The mesh in numbers; None (a one-device engine) is a 1 x 1 mesh of the default device."""
    if mesh is None:
        device = jax.devices()[0]
        return MeshInfo(1, 1, ((DATA_AXIS, 1), (MODEL_AXIS, 1)), device.device_kind)
    devices = mesh.devices.ravel()
    return MeshInfo(len(devices), len({d.process_index for d in devices}),
                    tuple((name, int(size)) for name, size in mesh.shape.items()), devices[0].device_kind)
