"""What the engine asks of a runner: the `Runner` protocol the engine is typed against.

`ModelRunner` is the one implementation that runs a model; tests drive the engine with fakes
(tests/engine/test_engine_fake_runner.py) that implement the same members, so the engine reads
them directly and probes nothing.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from jaxserve.runner.step_data import ModelRunnerOutput
from jaxserve.runner.step_feature import StepFeature


@runtime_checkable
class Runner(Protocol):
    # the step features its steps carry (runner/step_feature.py); the engine reads their names
    features: tuple[StepFeature, ...]
    # the engine whose block ids the arena's contents follow (engines sharing one runner:
    # LLM.sharing_runner); an engine that finds another there takes the runner over
    owner: object
    # a multi-host leader's step publisher (parallel/distributed.py), or None
    step_mirror: object
    # set while asleep (runner/sleep.py SleepState), else None
    sleep_state: object
    # the KV arena's plan (runner/kv_arena.py ArenaSpec; None: a runner without a real arena)
    arena_spec: object
    # the mesh the model is split over (parallel/mesh.py MeshInfo; None: one device)
    mesh_info: object

    def dispatch(self, sched_out, draft_sample: dict | None = None): ...

    def is_ready(self, handle) -> bool: ...

    def collect(self, handle) -> ModelRunnerOutput: ...


def carries(runner: Runner, feature: str) -> bool:
    """Whether the runner's steps carry the step feature of that name."""
    return any(f.name == feature for f in runner.features)
