"""LoRARequest: which adapter a request runs under (vLLM's shape: name, integer id, path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name, with the id a caller numbers it by and the PEFT directory it loads from
    (`adapter_config.json` + `adapter_model.safetensors`). A request naming an adapter that is not
    registered yet registers it from `lora_path` at the door; an empty path then is an error."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {self.lora_path!r}")
