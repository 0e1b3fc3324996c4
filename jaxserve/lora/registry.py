"""LoRARegistry: the adapters an engine knows, on the host, by name.

Registering reads and checks the PEFT directory once (lora/peft_adapter.py; `read_adapter`, which
touches nothing shared, so the fronts run it off the step thread and hand its result to `add`) and
keeps the adapter's slot values (lora/slot_layout.py) in host memory, so a device slot is (re)loaded from
here, never from the file again, however often the adapter is evicted. Each registration gets a
fresh `key` (name#serial): the scheduler's slots and the prefix cache follow keys, not names, so
an adapter registered again under the same name from other weights is never mixed with the old
one's slot or cached K/V.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from jaxserve.lora.peft_adapter import load_peft_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slot_layout import slot_values
from jaxserve.lora.targets import LoRATargets
from jaxserve.models.tensor_layout import Path


@dataclass(frozen=True)
class ReadAdapter:
    """A PEFT directory read, checked and laid out as slot values, not registered yet."""

    path: str
    rank: int
    target_modules: tuple[str, ...]
    values: dict[Path, tuple[np.ndarray, np.ndarray]]
    load_seconds: float


def read_adapter(request: LoRARequest, targets: LoRATargets, max_rank: int) -> ReadAdapter:
    """Read and check `request.lora_path` (ValueError: missing, or not fitting the model)."""
    if not request.lora_path:
        raise ValueError(f"LoRA adapter {request.lora_name!r} is not registered and its request has no lora_path")
    start = time.perf_counter()
    adapter = load_peft_adapter(request.lora_path, targets, max_rank)
    values = slot_values(adapter, targets, max_rank)
    return ReadAdapter(request.lora_path, adapter.rank, adapter.target_modules, values, time.perf_counter() - start)


@dataclass(frozen=True)
class RegisteredAdapter:
    request: LoRARequest
    key: str                                            # the weights' identity (name#serial)
    rank: int
    target_modules: tuple[str, ...]
    values: dict[Path, tuple[np.ndarray, np.ndarray]]   # one slot's arrays per projection
    load_seconds: float                                 # reading, checking and laying out


class LoRARegistry:
    def __init__(self, targets: LoRATargets, max_rank: int) -> None:
        self.targets = targets
        self.max_rank = max_rank
        self._by_name: dict[str, RegisteredAdapter] = {}
        self._serial = itertools.count(1)

    def add(self, request: LoRARequest, read: ReadAdapter | None = None) -> bool:
        """Register (or re-register, when the path or id changed) an adapter. False: that same
        adapter is registered already. A bad adapter raises ValueError and changes nothing.
        read: `read_adapter(request, ...)` already done (off the step thread); else read here."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"expected a LoRARequest, got {type(request).__name__}")
        current = self._by_name.get(request.lora_name)
        if current is not None and current.request == request:
            return False
        other = self.by_id(request.lora_int_id)
        if other is not None and other.request.lora_name != request.lora_name:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter {other.request.lora_name!r}")
        if read is None or read.path != request.lora_path:
            read = read_adapter(request, self.targets, self.max_rank)
        self._by_name[request.lora_name] = RegisteredAdapter(
            request, f"{request.lora_name}#{next(self._serial)}", read.rank, read.target_modules, read.values,
            read.load_seconds)
        return True

    def read(self, request: LoRARequest) -> ReadAdapter | None:
        """What `add(request)` would read, read now (any thread); None when nothing needs reading:
        the same adapter is registered already."""
        current = self._by_name.get(request.lora_name)
        if current is not None and current.request == request:
            return None
        return read_adapter(request, self.targets, self.max_rank)

    def remove(self, name_or_id: str | int) -> RegisteredAdapter | None:
        found = self.find(name_or_id)
        if found is not None:
            del self._by_name[found.request.lora_name]
        return found

    def find(self, name_or_id: str | int) -> RegisteredAdapter | None:
        if isinstance(name_or_id, int) and not isinstance(name_or_id, bool):
            return self.by_id(name_or_id)
        return self._by_name.get(name_or_id)

    def by_id(self, lora_int_id: int) -> RegisteredAdapter | None:
        return next((a for a in self._by_name.values() if a.request.lora_int_id == lora_int_id), None)

    def by_key(self, key: str) -> RegisteredAdapter | None:
        name = key.rsplit("#", 1)[0]
        found = self._by_name.get(name)
        return found if found is not None and found.key == key else None

    def is_registered(self, name: str) -> bool:
        return name in self._by_name

    def resolve(self, request: LoRARequest, read: ReadAdapter | None = None) -> RegisteredAdapter:
        """The adapter a request runs under: registered by name, else registered here from its
        path (the door: a bad path or adapter is a ValueError before anything is queued); read:
        its files already read off the step thread."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        found = self._by_name.get(request.lora_name)
        if found is None:
            self.add(request, read)
            found = self._by_name[request.lora_name]
        return found

    def list(self) -> list[LoRARequest]:
        return [a.request for a in self._by_name.values()]

    def __len__(self) -> int:
        return len(self._by_name)
