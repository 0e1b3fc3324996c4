"""LoRA slot writes as a step feature (runner/step_feature.py): before a step's forward pass the
runner writes the adapters its schedule put into device slots (SchedulerOutput.lora_loads),
from the registry's host copy, so the engine never writes device state. One host only (config.py
refuses LoRA with num_hosts > 1: the writes are not mirrored). A write waits for a background
warm-up run in progress (runner/background_warmup.py), which reads the arrays it donates."""

from __future__ import annotations

from jaxserve.lora.device_slots import DeviceLoRASlots
from jaxserve.lora.registry import LoRARegistry
from jaxserve.runner.step_feature import StepFeature


class LoRASlotWrites(StepFeature):
    name = "lora_slot_writes"
    mirrored = False

    def __init__(self, registry: LoRARegistry, device: DeviceLoRASlots):
        self.registry = registry
        self.device = device

    def pack(self, sched_out, bucket):
        # (slot, adapter key) pairs; a step that only moves blocks carries none
        return tuple(sched_out.lora_loads) if sched_out.lora_loads else None

    def before_step(self, loads) -> None:
        self.write(loads)

    def write(self, loads) -> None:
        for slot, key in loads:
            adapter = self.registry.by_key(key)
            if adapter is None:   # remove() refuses while requests use it: never expected
                raise RuntimeError(f"LoRA slot {slot}: adapter {key!r} is no longer registered")
            if self.device.resident.get(slot) != key:
                # the write donates the slot arrays: wait for a background warm-up run reading them
                with self.runner.params_lock:
                    self.runner.params = self.device.write(self.runner.params, slot, key, adapter.values)
