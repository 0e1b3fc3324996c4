"""Engine's LoRA methods (vLLM's names), a part of `Engine` (engine/engine.py): the adapters
themselves are `engine.lora` (lora/engine_lora.py EngineLoRA; None: enable_lora off)."""

from __future__ import annotations

from jaxserve.lora.registry import ReadAdapter
from jaxserve.lora.request import LoRARequest


class EngineLoRAMethods:
    def _adapter(self, lora_request: LoRARequest | None, read: ReadAdapter | None = None):
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs an engine built with enable_lora=True "
                             f"(jaxserve serve --enable-lora)")
        return self.lora.resolve(lora_request, read)

    def read_lora(self, lora_request: LoRARequest, *, for_request: bool = False) -> ReadAdapter | None:
        """Read an adapter's PEFT directory for add_lora (or, for_request, for a request that runs
        under it: read only when no adapter of its name is registered) on any thread: it changes
        no engine state, so the fronts run it off the step thread (~19 ms a load). None: nothing
        to read (no adapters here, or it is registered already). Errors wait for the engine's
        own registration to raise them, with its checks."""
        if self.lora is None or not isinstance(lora_request, LoRARequest):
            return None
        if for_request and self.lora.registry.is_registered(lora_request.lora_name):
            return None
        try:
            return self.lora.read(lora_request)
        except ValueError:
            return None

    # -- LoRA adapters (lora/engine_lora.py; vLLM's names) ----------------------------------
    def add_lora(self, lora_request: LoRARequest, read: ReadAdapter | None = None) -> bool:
        """Register an adapter from its PEFT directory on the host (read and checked now, unless
        `read` is read_lora's result; a device slot is given when a request needs it). False:
        that adapter is registered already."""
        if self.lora is None:
            raise ValueError("add_lora needs an engine built with enable_lora=True")
        return self.lora.add(lora_request, read)

    def remove_lora(self, name_or_id: str | int) -> bool:
        """Unregister an adapter by name or lora_int_id. False: no such adapter. ValueError while
        requests under it are live."""
        if self.lora is None:
            return False
        return self.lora.remove(name_or_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list()
