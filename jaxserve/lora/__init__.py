"""Multi-LoRA serving: adapters from PEFT directories in fixed device slots, per request.

request.py (LoRARequest), peft_adapter.py (reading and checking an adapter), targets.py (what an
adapter may target, from the model's tensor declaration), slot_layout.py (an adapter's factors as
one slot's arrays), registry.py (the host registry), device_slots.py (the slots on the device and
their writer), engine_lora.py (the engine's view of all of it). The delta itself is computed in
models/linear.py through models/lora_delta.py; the scheduler's side is sched/lora_slots.py.
"""

from jaxserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
