"""Sleep and wake up: the device memory a runner holds, handed to a colocated trainer and taken
back, with nothing compiled either way (Engine.sleep / wake_up; docs/rl.md).

What a runner holds on its devices is its KV arena (`kv_caches`), its params, the sampler's
neutral adjustment arrays (`ModelRunner.scratch_arrays()`: per logits-row count a [R, max_model_len] history and a
[R, V / 32] mask, put on the device again by the first step that needs them) and the previous
step's sampled ids (a few bytes, kept; so is a draft-coupled sampler's [R, V] "no draft" input).
Every level frees the arena and the neutral arrays; the levels, vLLM's 1 and 2 plus a KV-only one:

    0   the arena is freed; the weights stay on the devices (jaxserve's; vLLM has no level 0)
    1   the arena is freed and the weights are copied to host memory (numpy), their device
        buffers let go; wake_up puts them back
    2   the arena is freed and the weights are let go with no copy: new ones must come with
        update_weights before wake_up (a trainer that sends its weights after every step anyway)

While asleep `runner.kv_caches` is None and `runner.params` is a pytree of ShapeDtypeStructs with
the old shardings (levels 1 and 2), so update_weights checks and places an update against it as
against the arrays; a leaf an update placed while asleep is kept at wake_up, and only the leaves
still abstract come back from the host copy (level 2: none may be left).

Nothing recompiles: the compiled steps take params and arena as arguments. The arena is allocated
again by the function that allocated it (kv_arena.allocate_arena keeps its compiled zeros per
shape and sharding), and each weight is `jax.device_put` from its host copy onto the sharding it
had, which is what the executables were compiled for.

The arena's buffers are the runner's alone and are deleted at once. Weights may be shared: the
pytree form of update_weights uses a caller's array as it is, and a custom model's params are
served as given. So the runner drops its references to them and never deletes one; a buffer the
caller still holds stays alive, and the report counts those bytes (`weight_bytes_held_elsewhere`).
On the CPU backend a host copy of a weight is a copy (numpy would otherwise alias the very buffer).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.parallel.sharding import bytes_on_each_device

LEVELS = (0, 1, 2)


@dataclass(frozen=True, slots=True)
class SleepReport:
    """What one sleep() released, summed over the engine's runners (a draft model's too)."""

    level: int
    kv_cache_bytes: int                  # device bytes of the KV arena freed, all devices
    weight_bytes: int                    # device bytes of weights the engine let go (0 at level 0)
    weight_bytes_held_elsewhere: int     # of those, still alive because another reference holds them
    scratch_bytes: int                   # the sampler's neutral arrays, made again when needed
    host_weight_bytes: int               # host memory the level-1 copy of the weights takes
    bytes_per_device: tuple[tuple[int, int], ...]   # (device id, bytes let go there: all three kinds)
    seconds: float

    @property
    def total_bytes(self) -> int:
        return self.kv_cache_bytes + self.weight_bytes + self.scratch_bytes

    @property
    def freed_bytes(self) -> int:
        """Device bytes actually freed: what the engine let go less what others still hold."""
        return self.total_bytes - self.weight_bytes_held_elsewhere


@dataclass(frozen=True, slots=True)
class WakeUpReport:
    """What one wake_up() took back."""

    kv_cache_bytes: int        # device bytes of the arena allocated again
    weight_bytes: int          # device bytes of weights put back from the host copy
    seconds: float


@dataclass(slots=True)
class SleepState:
    """A sleeping runner's: how deep, its weights' host copy (level 1) and their abstract tree."""

    level: int
    abstract_params: object = None       # the ShapeDtypeStruct tree set as runner.params (levels 1, 2)
    host_params: object = None           # numpy leaves, the same tree (level 1)


def abstract_tree(params):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)


def is_abstract(leaf) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def _host_copy(params):
    """The params as numpy, owned by the host (never a view of a device buffer)."""
    host = jax.device_get(params)   # starts every leaf's copy before it waits for the first
    return jax.tree.map(lambda h: h if h.flags.owndata else np.array(h, copy=True), host)


class RunnerSleep:
    """ModelRunner's sleep and wake-up (a part of ModelRunner, as EngineControl is of Engine): the
    runner's own methods, so what they replace (params, kv_caches, sleep_state) is written by the
    runner itself."""

    def sleep(self, level: int) -> tuple[dict[int, int], dict[int, int], dict[int, int], int, int]:
        """Put the runner to sleep. Returns (arena, weight and scratch bytes per device, weight
        bytes still held elsewhere, host bytes of the weights' copy)."""
        if level not in LEVELS:
            raise ValueError(f"sleep level must be one of {LEVELS}, got {level!r}")
        if self.sleep_state is not None:
            raise RuntimeError(f"the runner is asleep already (level {self.sleep_state.level})")
        arena = bytes_on_each_device(self.kv_caches)
        state = SleepState(level)
        weights: dict[int, int] = {}
        held_elsewhere = host_bytes = 0
        if level >= 1:
            params = self.params
            refs = [(weakref.ref(x), bytes_on_each_device(x)) for x in jax.tree.leaves(params)]
            for _, held in refs:
                for device, n in held.items():
                    weights[device] = weights.get(device, 0) + n
            if level == 1:
                state.host_params = _host_copy(params)
                host_bytes = sum(h.nbytes for h in jax.tree.leaves(state.host_params))
            state.abstract_params = abstract_tree(params)
            self.params = state.abstract_params
            del params
            # what is still alive now is referenced outside the runner (the caller's arrays)
            held_elsewhere = sum(sum(b.values()) for r, b in refs if r() is not None and not r().is_deleted())
        for k, v in self.kv_caches:
            k.delete()
            v.delete()
        self.kv_caches = None
        scratch = bytes_on_each_device(self.scratch_arrays())
        self.forget_step_state()      # only the runner holds them: dropped, they are freed
        self.sleep_state = state
        return arena, weights, scratch, held_elsewhere, host_bytes

    def check_can_wake(self) -> None:
        """Level 2 dropped the weights: every leaf must have come back through update_weights."""
        state = self.sleep_state
        if state is None or state.level != 2:
            return
        missing = [jax.tree_util.keystr(p) for p, leaf in jax.tree_util.tree_flatten_with_path(self.params)[0]
                   if is_abstract(leaf)]
        if missing:
            raise ValueError(f"sleep(level=2) dropped the weights and {len(missing)} leaves have none yet "
                             f"(e.g. {missing[0]}): update_weights(params) with the whole pytree before wake_up()")

    def wake_up(self) -> tuple[int, int]:
        """Take the arena and weights back. Returns (arena bytes, weight bytes put back from the
        host copy). Raises, leaving the runner asleep, if something cannot come back."""
        state = self.sleep_state
        if state is None:
            return 0, 0
        self.check_can_wake()
        restored = 0
        params = self.params
        if state.level == 1:
            leaves, treedef = jax.tree.flatten(params)
            host = treedef.flatten_up_to(state.host_params)
            back = [jax.device_put(h, leaf.sharding) if is_abstract(leaf) else leaf for leaf, h in zip(leaves, host)]
            restored = sum(sum(bytes_on_each_device(b).values()) for b, leaf in zip(back, leaves)
                           if is_abstract(leaf))
            params = jax.tree.unflatten(treedef, back)
        kv_caches = self.allocate_arena()
        jax.block_until_ready((params, kv_caches))
        self.params, self.kv_caches = params, kv_caches
        self.sleep_state = None
        return sum(bytes_on_each_device(kv_caches).values()), restored


def report(level: int, per_runner: list[tuple], seconds: float) -> SleepReport:
    """One SleepReport from each runner's sleep() result."""
    per_device: dict[int, int] = {}
    kv = weights = scratch = held = host = 0
    for arena, weight, neutral, held_elsewhere, host_bytes in per_runner:
        kv += sum(arena.values())
        weights += sum(weight.values())
        scratch += sum(neutral.values())
        held += held_elsewhere
        host += host_bytes
        for held_on in (arena, weight, neutral):
            for device, n in held_on.items():
                per_device[device] = per_device.get(device, 0) + n
    return SleepReport(level=level, kv_cache_bytes=kv, weight_bytes=weights, weight_bytes_held_elsewhere=held,
                       scratch_bytes=scratch, host_weight_bytes=host,
                       bytes_per_device=tuple(sorted(per_device.items())), seconds=seconds)
