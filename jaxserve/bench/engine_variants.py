"""Engine variants measured side by side in one process: `--engine-variant NAME:KEY=VALUE,...`.

Each variant is the serving engine (EngineConfig's defaults, which the gRPC server runs, where
they differ from LLM's offline ones) with some fields overridden. Variants that change only
scheduling knobs (long_prefill_token_threshold, max_num_partial_prefills, max_waiting_requests,
... : whatever `LLM.sharing_runner` accepts) run on the compiled runner of one base engine, each
run on a fresh engine (scheduler, prefix cache, counters) over that runner: no load, no compile,
and every variant on the very same executables, so only the knob differs. A variant that changes
shapes (max_num_seqs, prefill_tile, buckets, ...) gets an engine of its own.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from jaxserve.bench.backend_base import Backend, BackendRun, RunOptions
from jaxserve.bench.backend_jaxserve import JaxServeBackend
from jaxserve.bench.workloads import BenchRequest
from jaxserve.engine_args import default_arg, engine_args

VARIANT_USAGE = ("expected NAME or NAME:KEY=VALUE[,KEY=VALUE...] with EngineConfig fields and Python-literal "
                 "values, e.g. t64:long_prefill_token_threshold=64")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_ITEM_START = re.compile(r",(?=\s*[A-Za-z_]\w*\s*=)")   # a comma that starts KEY=..., not one inside (1,4)


def serving_defaults() -> dict[str, Any]:
    """The server's settings where LLM's offline defaults differ (llm.py): the derived chunk and the
    serving prefill tile."""
    return {"long_prefill_token_threshold": None, "prefill_tile": default_arg("prefill_tile")}


@dataclass(frozen=True, slots=True)
class EngineVariant:
    name: str
    overrides: Mapping[str, Any] = field(default_factory=dict)   # EngineConfig fields over the base

    @classmethod
    def parse(cls, text: str) -> "EngineVariant":
        name, sep, rest = str(text).partition(":")
        name = name.strip()
        if not _NAME.match(name):
            raise ValueError(f"bad engine variant {text!r}: {VARIANT_USAGE}")
        overrides: dict[str, Any] = {}
        known = set(engine_args())
        for item in (_ITEM_START.split(rest) if sep and rest.strip() else []):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key or key in overrides:
                raise ValueError(f"bad engine variant {text!r}: {VARIANT_USAGE}")
            if key not in known:
                raise ValueError(f"bad engine variant {text!r}: {key!r} is not an engine argument")
            try:
                overrides[key] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                overrides[key] = value.strip()   # a bare word is a string (scheduling_policy=priority)
        if sep and not overrides:
            raise ValueError(f"bad engine variant {text!r}: nothing after the colon; {VARIANT_USAGE}")
        return cls(name, overrides)

    def __str__(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v!r}" for k, v in self.overrides.items()) if self.overrides else "")


def check_unique(variants: Sequence[EngineVariant]) -> None:
    names = [v.name for v in variants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"engine variant names must be unique, repeated: {dupes}")


def share_runner(llm: Any, overrides: Mapping[str, Any]) -> Any:
    """A fresh LLM on `llm`'s compiled runner; ValueError when an override would change shapes."""
    sharing = getattr(type(llm), "sharing_runner", None)
    if sharing is None:
        raise ValueError(f"{type(llm).__name__} cannot share its runner")
    return sharing(llm, **overrides)


class SharedRunnerBackend(JaxServeBackend):
    """A variant on the base backend's runner. Every run gets a fresh engine over it, so no
    scheduler state, prefix cache or counter carries over from another variant's run."""

    def __init__(self, base: JaxServeBackend, variant: EngineVariant, label: str) -> None:
        # not JaxServeBackend.__init__, which loads weights and compiles: that is what we share
        self.base = base
        self.overrides = dict(variant.overrides)
        self.engine_kwargs = {**base.engine_kwargs, **self.overrides}
        self.label = label
        self.api = base.api
        self.kv_trace = base.kv_trace
        self.checkpoint_identity = base.checkpoint_identity
        self.startup_s = 0.0
        self.llm = share_runner(base.llm, self.overrides)   # fails here, at build, if it cannot share

    def run(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun:
        self.llm = share_runner(self.base.llm, self.overrides)
        run = super().run(requests, options)
        run.config["shares_runner_of"] = self.base.label
        return run

    def close(self) -> None:
        self.llm = None   # the base, which owns the runner, is closed by whoever built it


def build_variants(session: Any, variants: Sequence[EngineVariant], base_overrides: Mapping[str, Any]
                   ) -> tuple[list[tuple[EngineVariant, Backend]], list[Backend]]:
    """(variant, backend) for every variant that could be built, and the backends to close at the
    end (the base and the variants with engines of their own). `session` is a bench Session: a
    variant that fails to build is recorded in its `skipped`."""
    owned: list[Backend] = []
    base = session.build("jaxserve", "jaxserve[base]", dict(base_overrides))
    if base is None:
        return [], owned
    owned.append(base)
    built: list[tuple[EngineVariant, Backend]] = []
    for v in variants:
        try:
            built.append((v, SharedRunnerBackend(base, v, v.name)))
            continue
        except ValueError:
            pass   # a knob that changes shapes (or a bad value, which the engine of its own reports)
        try:
            own = session.build("jaxserve", v.name, {**base_overrides, **v.overrides})
        except ValueError as e:
            session.skipped.append({"backend": v.name, "reason": f"failed: ValueError: {e}"})
            continue
        if own is not None:
            owned.append(own)
            built.append((v, own))
    return built, owned
