"""EngineLoRA: an engine's adapters, kept in step across the host registry, the scheduler's slot
component and the device slots.

Built by the engine builder when `enable_lora` is on (`slotted_params` before the runner is made,
so every step is compiled with the slot arrays; `attach` once the engine exists, which compiles
the slot writer before the engine counts compilations). The engine's door resolves a request's
LoRARequest here (registering it from its path if needed), and before each step is dispatched
the loads its schedule assigned are written into their slots (`apply_loads`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.lora.device_slots import DeviceLoRASlots, with_empty_slots
from jaxserve.lora.registry import LoRARegistry, RegisteredAdapter
from jaxserve.lora.request import LoRARequest
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
    def __init__(self, registry: LoRARegistry, device: DeviceLoRASlots, runner, scheduler) -> None:
        self.registry = registry
        self.device = device
        self.runner = runner
        self.scheduler = scheduler

    def add(self, request: LoRARequest) -> bool:
        return self.registry.add(request)

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

    def resolve(self, request: LoRARequest) -> RegisteredAdapter:
        return self.registry.resolve(request)

    def apply_loads(self, loads) -> None:
        """Write the adapters a step's schedule put into slots (SchedulerOutput.lora_loads)."""
        for slot, key in loads:
            adapter = self.registry.by_key(key)
            if adapter is None:   # remove() refuses while requests use it: never expected
                raise RuntimeError(f"LoRA slot {slot}: adapter {key!r} is no longer registered")
            if self.device.resident.get(slot) != key:
                self.runner.params = self.device.write(self.runner.params, slot, key, adapter.values)

    def stats(self) -> LoRAStats:
        slots = self.scheduler.lora_slots
        return LoRAStats(len(self.registry), len(slots.resident()), slots.num_held(), slots.num_loads,
                         slots.num_evictions)


def attach(engine, model_config, max_loras: int, max_rank: int, heads=None, mesh=None) -> None:
    """Give a built engine its adapters: the registry, and the slot writer compiled now."""
    targets = lora_targets(model_config, heads)
    device = DeviceLoRASlots(targets, max_loras, mesh)
    engine.runner.params = device.warm(engine.runner.params)
    engine.lora = EngineLoRA(LoRARegistry(targets, max_rank), device, engine.runner, engine.scheduler)
