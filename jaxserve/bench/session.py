"""One benchmark invocation: resolve the model once, build backends one after the other, write results.

Backends are built, run and closed in turn (never two models in memory at once; the one
exception is `bench throughput --repeats`, bench/repeats.py, where they take turns). A backend that
cannot run here (not installed, feature missing) is skipped with a message that says why; one
that fails mid-run is reported with its traceback; both are recorded in the result's
`extra.skipped`, and the other backends' runs are kept.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from typing import Any, Callable, Sequence

from jaxserve.bench import plots as plot_module
from jaxserve.bench.args import engine_kwargs, jsonable_args
from jaxserve.bench.backend_base import Backend, BackendRun, RunOptions, UnsupportedBackend
from jaxserve.bench.backends import make_backend
from jaxserve.bench.environment import environment
from jaxserve.bench.model_files import files_sha256, load_tokenizer, resolve_model
from jaxserve.bench.results import build_result, write_result
from jaxserve.bench.summary import format_result
from jaxserve.bench.workloads import BenchRequest, Workload


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Session:
    def __init__(self, args: argparse.Namespace, subcommand: str) -> None:
        self.args = args
        self.subcommand = subcommand
        self.spec = resolve_model(args.model)
        self._tokenizer: Any = None
        self.skipped: list[dict[str, str]] = []
        self.max_seq_len = 2048  # longest prompt + output of the workload; commands set it before building
        # the code that runs is the code at start: record its commit and time now, not at the end
        self._started = {"git_commit": environment()["git_commit"],
                         "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            log(f"loading the tokenizer of {self.spec.path}")
            self._tokenizer = load_tokenizer(self.spec)
        return self._tokenizer

    def stop_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if isinstance(eos, int) else []

    def options(self, timed_arrivals: bool = False, max_concurrency: int | None = None) -> RunOptions:
        return RunOptions(max_concurrency=max_concurrency, progress=not self.args.no_progress,
                          timed_arrivals=timed_arrivals)

    def build(self, name: str, label: str | None = None, overrides: dict[str, Any] | None = None) -> Backend | None:
        a = self.args
        log(f"building backend {label or name} (loading weights, compiling: not timed)")
        try:
            return make_backend(
                name, self.spec, engine_kwargs={**engine_kwargs(a), **(overrides or {})}, label=label,
                hf_batch_size=a.hf_batch_size, hf_cb_max_requests=a.hf_cb_max_requests,
                hf_cb_max_batch_tokens=a.hf_cb_max_batch_tokens, jaxserve_api=a.jaxserve_api,
                max_seq_len=self.max_seq_len, dtype=a.dtype, progress=not a.no_progress,
            )
        except UnsupportedBackend as e:
            log(f"skipping backend {label or name}: {e}")
            self.skipped.append({"backend": label or name, "reason": str(e)})
            return None

    def build_with_speculation(self, name: str) -> list[Backend]:
        """The backends `name` stands for, in the order to run them (close them all after): itself,
        or with --speculative-config, jaxserve twice on one compiled runner: without speculation
        ("jaxserve", a fresh engine over the runner) and with it ("jaxserve+spec", which owns the
        runner, built with speculation's decode buckets)."""
        spec = getattr(self.args, "speculative_config", None)
        if name != "jaxserve" or not spec:
            backend = self.build(name)
            return [] if backend is None else [backend]
        from jaxserve.bench.engine_variants import EngineVariant, SharedRunnerBackend

        with_spec = self.build(name, "jaxserve+spec", {"speculative_config": spec})
        if with_spec is None:
            return []
        return [SharedRunnerBackend(with_spec, EngineVariant("jaxserve", {"speculative_config": None}), "jaxserve"),
                with_spec]

    def sized_for(self, *workloads: Workload) -> None:
        """Backends that preallocate (hf-cb) size their caches for the longest sequence of these."""
        self.max_seq_len = max(w.summary()["max_seq_len"] for w in workloads)

    def warm(self, backend: Backend, warmup: Sequence[BenchRequest]) -> bool:
        """Untimed warmup requests; False (and recorded) if the backend failed on them."""
        if warmup and hasattr(backend, "warmup"):
            log(f"warming up {backend.label} with {len(warmup)} request(s)")
            try:
                backend.warmup(warmup)
            except Exception as e:
                log(f"{backend.label} failed during warmup:\n{traceback.format_exc()}")
                self.skipped.append({"backend": backend.label, "reason": f"failed: {type(e).__name__}: {e}"})
                return False
        return True

    def run(self, backend: Backend, requests: Sequence[BenchRequest], options: RunOptions,
            config: dict[str, Any] | None = None) -> BackendRun | None:
        load_before = _load_average()
        try:
            run = backend.run(requests, options)
        except UnsupportedBackend as e:
            log(f"skipping {backend.label}: {e}")
            self.skipped.append({"backend": backend.label, "reason": str(e)})
            return None
        except Exception as e:  # one backend's failure must not lose the others' runs
            log(f"{backend.label} failed:\n{traceback.format_exc()}")
            self.skipped.append({"backend": backend.label, "reason": f"failed: {type(e).__name__}: {e}"})
            return None
        run.config.update(config or {})
        # other jobs on the machine skew every number: record how busy it was around the run
        run.config["load_average_before_after"] = [load_before, _load_average()]
        return run

    def finish(self, workload: Workload, runs: list[BackendRun], extra: dict[str, Any] | None = None,
               plots: Sequence[Callable[[dict[str, Any], str], str]] = ()) -> dict[str, Any]:
        if not runs:
            raise SystemExit(f"no backend ran: {self.skipped}")
        model = {"path": self.spec.path, "kind": self.spec.kind, "files_sha256": files_sha256(self.spec)}
        result = build_result(self.subcommand, jsonable_args(self.args), {**environment(), **self._started}, model,
                              workload.summary(), runs, self.stop_ids(),
                              extra={**(extra or {}), "skipped": self.skipped})
        path = write_result(result, self.args.output_dir, self.args.name)
        print(format_result(result))
        written = [path]
        if plots and not self.args.no_plots and not plot_module.available():
            print("\nplots skipped: matplotlib is not installed (pip install 'jaxserve[bench]')")
        elif not self.args.no_plots:
            stem = os.path.splitext(path)[0]
            for plot in plots:
                written.append(plot(result, f"{stem}-{plot.__name__.replace('_', '-')}.png"))
        result["files"] = written
        print("\nwrote " + ", ".join(written))
        return result
