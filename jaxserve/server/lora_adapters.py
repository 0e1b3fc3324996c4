"""LoRA adapters as the server's fronts see them: by name, shared by HTTP and gRPC.

A request names its adapter as OpenAI's `model` (HTTP) or `GenerateRequest.lora_name` (gRPC);
adapters are registered at start (`--lora-modules name=path ...`) or at run time
(`POST /v1/load_lora_adapter`, the `LoadLoRAAdapter` RPC) and dropped the same ways. The engine
keeps the registry (lora/registry.py); this module only turns names into the engine's
`LoRARequest`s and numbers the adapters a front registers (vLLM's fronts do the same: a client
names an adapter, it never picks its integer id).

Finding an adapter by name reads one dict entry of the engine's registry from the event loop (a
single `dict.get`, atomic under the GIL), so a request under an adapter costs no round trip to
the step thread; registering and dropping run on the step thread, between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.lora.request import LoRARequest


class AdapterConflict(ValueError):
    """A load under a name in use (an adapter's, or the base model's): the request is well formed,
    the server's state refuses it (HTTP 409)."""


class AdapterNotFound(LookupError):
    """No adapter is registered under that name."""


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One `--lora-modules` entry: an adapter registered before the server turns SERVING."""

    name: str
    path: str


def parse_lora_modules(specs: list[str] | None) -> list[LoRAModule]:
    """`name=path` entries (vLLM's --lora-modules form); a malformed or repeated name is a ValueError."""
    modules: list[LoRAModule] = []
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH (a PEFT adapter directory)")
        if any(m.name == name.strip() for m in modules):
            raise ValueError(f"--lora-modules names {name.strip()!r} twice")
        modules.append(LoRAModule(name.strip(), path.strip()))
    return modules


def registered(engine, name: str) -> LoRARequest | None:
    """The adapter registered under `name` on a built engine, or None (safe from any thread)."""
    lora = getattr(engine, "lora", None)
    if lora is None:
        return None
    found = lora.registry.find(name)
    return None if found is None else found.request


def _next_id(loras: list[LoRARequest]) -> int:
    return max((r.lora_int_id for r in loras), default=0) + 1


def check_enabled(engine) -> None:
    if getattr(engine, "lora", None) is None:
        raise ValueError("this server does not serve LoRA adapters: start it with --enable-lora")


def register_now(engine, name: str, path: str, read=None) -> LoRARequest:
    """Register an adapter on the engine (called on its step thread, or before it serves). A name
    already in use, a missing path or an adapter that does not fit the model is a ValueError.
    read: its files read beforehand off the step thread (Engine.read_lora; None: read here)."""
    check_enabled(engine)
    if not name:
        raise ValueError("lora_name must be a non-empty string")
    if not path:
        raise ValueError("lora_path must name a PEFT adapter directory")
    if name == engine.model_name:
        raise AdapterConflict(f"lora_name {name!r} is the base model's name; pick another")
    if registered(engine, name) is not None:
        raise AdapterConflict(f"the LoRA adapter {name!r} is already loaded; unload it first to load other weights")
    request = LoRARequest(name, _next_id(engine.list_loras()), path)
    engine.add_lora(request, read)
    return request


def unregister_now(engine, name: str) -> None:
    """Drop an adapter (on the step thread). AdapterNotFound for an unknown name; a ValueError
    while requests under it are live (the engine refuses)."""
    check_enabled(engine)
    if not engine.remove_lora(name):
        raise AdapterNotFound(f"no LoRA adapter is loaded under the name {name!r}")


async def load_adapter(aengine, name: str, path: str) -> LoRARequest:
    # the PEFT directory is read off the step thread (the id is the step thread's to choose: the
    # read is made under a provisional one, and the registry keeps it only if the request matches)
    read = await aengine.run_off_step_thread(_read_ahead, aengine.engine, name, path)
    return await aengine.call(lambda engine: register_now(engine, name, path, read))


def _read_ahead(engine, name: str, path: str):
    # a bad name or path is left to register_now, which refuses it with its own message
    return engine.read_lora(LoRARequest(name, 1, path)) if name and path else None


async def unload_adapter(aengine, name: str) -> None:
    await aengine.call(lambda engine: unregister_now(engine, name))


def adapter_for(engine, name: str | None) -> LoRARequest | None:
    """The LoRARequest a request naming `name` runs under: None for no name or the base model's
    name; AdapterNotFound for a name neither the base model nor a registered adapter has."""
    if name is None or name == "" or name == engine.model_name:
        return None
    check_enabled(engine)
    found = registered(engine, name)
    if found is None:
        raise AdapterNotFound(name)
    return found
