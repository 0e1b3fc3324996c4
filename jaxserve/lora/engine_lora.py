"""EngineLoRA: an engine's adapters, kept in step across the host registry, the scheduler's slot
component and the device slots.

Built by the engine builder when `enable_lora` is on (`slotted_params` before the runner is made,
so every step is compiled with the slot arrays; `build` before the engine exists, which compiles
the slot writer before the engine counts compilations and gives the runner its slot-write
feature, lora/slot_writes.py: the runner writes the loads each step's schedule assigned, before
the step). The engine's door resolves a request's LoRARequest here (registering it from its path
if needed); the fronts read an adapter's files off the step thread first (`read`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.lora.device_slots import DeviceLoRASlots, with_empty_slots
from jaxserve.lora.registry import LoRARegistry, ReadAdapter, RegisteredAdapter
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slot_writes import LoRASlotWrites
from jaxserve.lora.targets import LoRATargets
from jaxserve.models import registry as model_registry


def lora_targets(model_config, heads=None) -> LoRATargets:
    """model_config: the checkpoint's (KV heads not replicated); heads: the tensor-parallel
    HeadLayout the params are stored in, or None on one device."""
    return LoRATargets.from_layout(model_registry.for_config(model_config).layout(model_config), heads)


def slotted_params(params: dict, model_config, max_loras: int, max_rank: int, heads=None, mesh=None) -> dict:
    """The base params with empty LoRA slots beside every projection (split over `mesh` with them)."""
    return with_empty_slots(params, lora_targets(model_config, heads), max_loras, max_rank, mesh)


@dataclass
class LoRAStats:
    num_registered: int
    num_resident: int
    num_slots_held: int      # slots running requests hold
    num_loads: int           # adapters written into a slot (first loads and reloads after eviction)
    num_evictions: int


class EngineLoRA:
    def __init__(self, registry: LoRARegistry, device: DeviceLoRASlots, scheduler) -> None:
        self.registry = registry
        self.device = device
        self.scheduler = scheduler

    def read(self, request: LoRARequest) -> ReadAdapter | None:
        """Read an adapter's files for a later `add` or `resolve` (any thread: touches nothing
        shared); None when that adapter is registered already."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"expected a LoRARequest, got {type(request).__name__}")
        return self.registry.read(request)

    def add(self, request: LoRARequest, read: ReadAdapter | None = None) -> bool:
        return self.registry.add(request, read)

    def remove(self, name_or_id: str | int) -> bool:
        """Unregister an adapter. False: none by that name or id. Refused (ValueError) while
        requests under it are waiting or running: their slot loads read its host copy."""
        found = self.registry.find(name_or_id)
        if found is None:
            return False
        live = [r.request_id for r in (*self.scheduler.running, *self.scheduler.waiting) if r.lora_key == found.key]
        if live:
            raise ValueError(f"LoRA adapter {found.request.lora_name!r} has {len(live)} live request(s) "
                             f"({', '.join(live[:3])}); abort them or let them finish first")
        self.registry.remove(name_or_id)
        self.scheduler.lora_slots.forget(found.key)
        return True

    def list(self) -> list[LoRARequest]:
        return self.registry.list()

    def resolve(self, request: LoRARequest, read: ReadAdapter | None = None) -> RegisteredAdapter:
        return self.registry.resolve(request, read)

    def stats(self) -> LoRAStats:
        slots = self.scheduler.lora_slots
        return LoRAStats(len(self.registry), len(slots.resident()), slots.num_held(), slots.num_loads,
                         slots.num_evictions)


def build(runner, scheduler, model_config, max_loras: int, max_rank: int, heads=None, mesh=None, *,
          warm_writer: bool = True) -> EngineLoRA:
    """An engine's adapters: the registry, and the slot writer, handed to the runner as a step
    feature; compiled now, or (warm_writer=False: a server warming in the background) by the
    warm-up thread's helpers, a first write before then compiling it itself."""
    targets = lora_targets(model_config, heads)
    device = DeviceLoRASlots(targets, max_loras, mesh)
    registry = LoRARegistry(targets, max_rank)
    if warm_writer:
        device.warm(runner.params)
    runner.add_feature(LoRASlotWrites(registry, device))
    return EngineLoRA(registry, device, scheduler)
