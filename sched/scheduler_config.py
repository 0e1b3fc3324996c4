"""The scheduler's knobs: one frozen dataclass, validated once.

The engine builds it from its own EngineConfig (the KV pool size comes from the runner's arena,
possibly capped by tests to create pressure).
"""

from __future__ import annotations

from dataclasses import dataclass


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks the scheduler may use, including the reserved null block 0
    block_size: int = 16
    max_num_seqs: int = 128  # seats: requests holding blocks at once
    max_num_batched_tokens: int = 2048  # tokens computed per step, over all requests
    max_model_len: int = 2048  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # max tokens of one request per step; 0 = no cap
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            _positive_int(name, getattr(self, name))
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0, got {t!r}")
        if not self.enable_chunked_prefill:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"with enable_chunked_prefill=False a prompt is scheduled whole, so "
                    f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                    f"max_model_len={self.max_model_len}"
                )
            if t:
                raise ValueError(
                    f"long_prefill_token_threshold={t} cuts prompts into chunks; it needs "
                    f"enable_chunked_prefill=True"
                )

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1
