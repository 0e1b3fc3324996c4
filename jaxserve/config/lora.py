"""LoRA adapters served beside the base model: device slots and their rank."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.options import check_positive_int, option


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT directories) per request beside the base model: max_loras device slots "
               "of rank max_lora_rank beside every projection, one batch mixing adapters freely; adapters register "
               "by LLM/Engine.add_lora or a request's LoRARequest; speculation only by ngram, one device, no "
               "batch_invariant (docs/design.md, LoRA adapters)")
    max_loras: int = option(1, "enable_lora: adapters resident on the device at once (device slots); more "
                               "registered adapters wait on the host and take a slot when a request needs one "
                               "(least recently used idle slot evicted)")
    max_lora_rank: int = option(16, "enable_lora: the largest adapter rank served (every slot has this rank; "
                                    "smaller ranks are padded with zeros, larger ones refused)")

    def __post_init__(self) -> None:
        check_positive_int(self, "max_loras", "max_lora_rank")

    @property
    def slots(self) -> int:
        """Device slots the scheduler hands out (0: LoRA off)."""
        return self.max_loras if self.enable_lora else 0
