"""EasyDeL's eSurge (a JAX port of vLLM V1) on the same model, in its own venv, through a pipe.

EasyDeL pins jax, flax and transformers at versions jaxserve does not run, so eSurge lives in a
venv of its own (`bash scripts/esurge/setup.sh`) and runs as a child process:
jaxserve/bench/esurge_driver.py, spoken to in JSON lines (its docstring has the protocol). It
reads Hugging Face checkpoints only: a GGUF is converted once to an HF float32 directory
(jaxserve/bench/hf_export.py), the same float32 weights jaxserve and `hf` dequantize to.

The driver runs the closed loop beside the engine (at most --max-concurrency requests in it at
once; all of them without a cap, queued by eSurge past max_num_seqs) and stamps each token when
the engine's scheduler thread hands out the step that produced it. Its times are shifted to this
process's clock by the instant the run command was written (one constant per run). Greedy only,
exactly output_len tokens per request (EOS ignored), every request sent at the start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from typing import Any, Sequence

from jaxserve.bench.backend_base import BackendRun, RunOptions, UnsupportedBackend
from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.model_files import ModelSpec, files_sha256
from jaxserve.bench.progress import progress_bar
from jaxserve.bench.workloads import BenchRequest

SETUP = "bash scripts/esurge/setup.sh"
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "esurge_driver.py")
DEFAULT_MAX_NUM_SEQS = 16    # as hf-cb's default batch: the bench's concurrency sweeps stay under it
PAGE = 128                   # eSurge's default page size: max_model_len is rounded up to whole pages


def esurge_venv() -> str:
    """$JAXSERVE_ESURGE_VENV, else where scripts/esurge/setup.sh puts it."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.environ.get("JAXSERVE_ESURGE_VENV") or os.path.join(cache, "jaxserve", "esurge-venv")


def venv_python(venv: str) -> str:
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        raise UnsupportedBackend(f"esurge runs in its own venv, and {venv} has none: {SETUP}")
    return python


def model_len_for(max_seq_len: int, engine_kwargs: dict[str, Any]) -> int:
    """--max-model-len if given, else the workload's longest sequence in whole pages."""
    if engine_kwargs.get("max_model_len"):
        return int(engine_kwargs["max_model_len"])
    return -(-max(1, max_seq_len) // PAGE) * PAGE


class DriverError(RuntimeError):
    """The driver answered a command with an error line, or died."""


class ESurgeBackend:
    name = "esurge"

    def __init__(self, spec: ModelSpec, engine_kwargs: dict[str, Any] | None = None, *, max_seq_len: int = 2048,
                 dtype: str = "float32", label: str | None = None, venv: str | None = None,
                 attn_mechanism: str | None = None) -> None:
        kw = dict(engine_kwargs or {})
        python = venv_python(venv or esurge_venv())
        if dtype == "auto":
            dtype = "float32"  # the eSurge venv's jax is the CPU build
        from jaxserve.bench.hf_export import ensure_hf_dir

        t = time.perf_counter()
        self.model_dir = ensure_hf_dir(spec)
        self.convert_s = time.perf_counter() - t
        self.max_num_seqs = int(kw.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
        self.max_model_len = model_len_for(max_seq_len, kw)
        self.label = label or f"esurge[seqs={self.max_num_seqs}]"
        self.checkpoint_identity = files_sha256(spec)
        self._stderr = tempfile.TemporaryFile(mode="w+", prefix="esurge-driver-")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.pop("PYTHONPATH", None)  # jaxserve's paths must not leak into the other venv
        t = time.perf_counter()
        self.proc = subprocess.Popen([python, DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True, env=env,
                                     start_new_session=True)  # its group: eSurge's worker processes too
        try:
            hello = self._read()
            if hello.get("event") == "error":
                raise UnsupportedBackend(f"easydel does not import in {venv or esurge_venv()} "
                                         f"({hello['message']}): {SETUP}")
            self.versions = hello.get("versions", {})
            load = {"cmd": "load", "model_dir": self.model_dir, "max_model_len": self.max_model_len,
                    "max_num_seqs": self.max_num_seqs, "dtype": dtype,
                    "max_num_batched_tokens": kw.get("max_num_batched_tokens"),
                    "enable_prefix_caching": kw.get("enable_prefix_caching")}
            if attn_mechanism:
                load["attn_mechanism"] = attn_mechanism
            loaded = self._command(load, "loaded")
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - t        # process start, imports, load, compile
        self.engine_startup_s = loaded["startup_s"]     # eSurge(...) + initiate() alone
        self.engine_config = loaded["config"]

    def _stderr_tail(self, n: int = 3000) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()[-n:]

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            rc = self.proc.wait()
            raise DriverError(f"the esurge driver exited ({rc}); its stderr ends:\n{self._stderr_tail()}")
        return json.loads(line)

    def _send(self, cmd: dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(cmd, separators=(",", ":")) + "\n")
        self.proc.stdin.flush()

    def _command(self, cmd: dict[str, Any], expect: str) -> dict[str, Any]:
        self._send(cmd)
        event = self._read()
        if event.get("event") == "error":
            raise DriverError(f"esurge {cmd['cmd']} failed: {event['message']}\n{event.get('traceback', '')}")
        if event.get("event") != expect:
            raise DriverError(f"esurge {cmd['cmd']}: expected {expect!r}, got {event!r}")
        return event

    def _run(self, requests: Sequence[BenchRequest], max_concurrency: int | None,
             on_done: Any = None) -> tuple[float, dict[str, dict[str, Any]], float]:
        """(anchor, done events by id, driver duration); anchor = our perf_counter at the run's zero."""
        for r in requests:
            if len(r.prompt_token_ids) + r.output_len > self.max_model_len:
                raise ValueError(f"request {r.request_id!r}: {len(r.prompt_token_ids)} + {r.output_len} tokens "
                                 f"exceed esurge's max_model_len {self.max_model_len}")
        cmd = {"cmd": "run", "max_concurrency": max_concurrency,
               "requests": [{"id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids),
                             "max_tokens": r.output_len} for r in requests]}
        anchor = time.perf_counter()
        self._send(cmd)
        done: dict[str, dict[str, Any]] = {}
        while True:
            event = self._read()
            kind = event.get("event")
            if kind == "error":
                raise DriverError(f"esurge run failed: {event['message']}\n{event.get('traceback', '')}")
            if kind == "run_done":
                return anchor, done, float(event["duration_s"])
            if kind != "done":
                raise DriverError(f"esurge run: unexpected {event!r}")
            done[event["id"]] = event
            if on_done:
                on_done(event)

    def warmup(self, requests: Sequence[BenchRequest]) -> None:
        if requests:
            self._run(list(requests), None)

    def run(self, requests: Sequence[BenchRequest], options: RunOptions) -> BackendRun:
        if any(r.temperature for r in requests):
            raise UnsupportedBackend("esurge here decodes greedily; a sampled workload (--temperature) runs on jaxserve")
        if options.timed_arrivals:
            raise UnsupportedBackend("esurge sends every request at the start (closed loop): use --request-rate inf")
        with progress_bar(len(requests), self.label, options.progress) as bar:
            anchor, done, _ = self._run(requests, options.max_concurrency, lambda e: bar.update(1))
        records, outputs, notes = [], {}, set()
        for r in requests:
            e = done[r.request_id]
            toks = [int(t) for t in e["token_ids"]]
            times = tuple(anchor + t for t in e["token_times_s"])
            if "hook_token_ids" in e:
                notes.add("some requests' stamped tokens differ from eSurge's own record: their token times are dropped")
            if len(times) != len(toks) or "hook_token_ids" in e:
                times = ()
            arrival = anchor + e["submitted_s"]
            finished = times[-1] if times else anchor + max(e["token_times_s"] or [e["submitted_s"]])
            outputs[r.request_id] = toks
            records.append(RequestRecord(
                request_id=r.request_id, prompt_len=len(r.prompt_token_ids), output_len=len(toks),
                arrival_time=arrival, first_token_time=times[0] if times else finished, finished_time=finished,
                token_times=times, group=r.group))
        duration = max(x.finished_time for x in records) - min(x.arrival_time for x in records)
        notes |= {
            "closed loop in the driver beside the engine (at most max_concurrency requests in eSurge); "
            "tokens stamped when eSurge's scheduler thread hands out the step that made them",
            "queue time not observable (eSurge does not report when a request is first scheduled)",
            "prompts go in as token ids through eSurge's internal _add_request (its public API takes text)",
        }
        return BackendRun(
            self.name, self.label, records, duration, self.checkpoint_identity,
            config={"engine": self.engine_config, "startup_s": self.startup_s,
                    "engine_startup_s": self.engine_startup_s, "convert_s": self.convert_s,
                    "model_dir": self.model_dir, "versions": self.versions,
                    "max_concurrency": options.max_concurrency},
            output_token_ids=outputs, notes=sorted(notes))

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is None:
            return
        self.proc = None
        try:
            if proc.poll() is None:
                proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                proc.stdin.flush()
                proc.wait(timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            # eSurge's tokenizer/detokenizer workers are the driver's children in its process
            # group; the driver stops them, but one that died or was killed cannot
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            self._stderr.close()
