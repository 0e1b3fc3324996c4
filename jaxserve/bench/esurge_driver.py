"""EasyDeL's eSurge engine behind a pipe: run by the eSurge venv's python, spoken to by backend_esurge.

This file must not import jaxserve: it runs in the separate venv (scripts/esurge/setup.sh) whose
jax, flax and transformers pins differ from jaxserve's. It imports only the standard library at
module level (so jaxserve's tests can check the protocol), and easydel once it serves.

Protocol: one JSON object per line. The driver answers on its stdout (which it keeps for itself:
everything the libraries print goes to stderr), the caller writes commands to its stdin.

  driver -> {"event": "hello", "versions": {...}}            easydel imported (or an "error" line)
  {"cmd": "load", "model_dir": DIR, "max_model_len": N, "max_num_seqs": N, "dtype": "float32", ...}
  driver -> {"event": "loaded", "startup_s": S, "config": {...}}
  {"cmd": "run", "max_concurrency": N or null,
   "requests": [{"id": ID, "prompt_token_ids": [...], "max_tokens": N}, ...]}
  driver -> {"event": "done", "id": ID, "submitted_s": S, "token_ids": [...], "token_times_s": [...]}
            one per request as it finishes, then {"event": "run_done", "duration_s": S}
  {"cmd": "quit"}
  driver -> {"event": "error", "message": ..., "traceback": ...}   for a command that failed

Times: every `*_s` of a run is time.perf_counter() in the driver minus the driver's perf_counter()
when it read the run command. The caller adds its own perf_counter() from just before it wrote
that command: one constant shift (the pipe's latency, well under a millisecond) for the whole
run, so durations, TTFT and inter-token gaps are exact in the driver's clock.

What eSurge is asked to do: greedy (temperature 0), exactly max_tokens tokens (ignore_eos, and
min_tokens = max_tokens), the prompt as the caller's token ids (never re-tokenized), no tool or
reasoning parser, and no silent prompt truncation or output capping (strict context). The
closed loop is here, beside the engine, so no pipe round trip sits between a request finishing
and the next one entering: at most max_concurrency requests are in the engine at once.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

# On a CPU, eSurge's default attention (ragged_page_attention_v3) runs ejkernel's XLA version,
# which cannot read the v3 KV layout EasyDeL writes for head_dim 64 (SmolLM2's): K and V share
# one 128-wide row there, and the kernel reshapes expecting 2 x 128. v2 stores K and V as heads.
DEFAULT_ATTENTION = "ragged_page_attention_v2"


@dataclass(frozen=True, slots=True)
class LoadCommand:
    model_dir: str
    max_model_len: int
    max_num_seqs: int
    dtype: str = "float32"
    attn_mechanism: str = DEFAULT_ATTENTION
    max_num_batched_tokens: int | None = None
    page_size: int | None = None
    hbm_utilization: float | None = None
    enable_prefix_caching: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # any other eSurge(...) keyword


@dataclass(frozen=True, slots=True)
class RunRequest:
    id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class RunCommand:
    requests: tuple[RunRequest, ...]
    max_concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class QuitCommand:
    pass


class ProtocolError(ValueError):
    """A line that is not a well-formed command."""


def _int(obj: dict, key: str, *, minimum: int, optional: bool = False) -> int | None:
    v = obj.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ProtocolError(f"{key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def parse_command(line: str) -> LoadCommand | RunCommand | QuitCommand:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError("a command is a JSON object")
    cmd = obj.get("cmd")
    if cmd == "quit":
        return QuitCommand()
    if cmd == "load":
        if not isinstance(obj.get("model_dir"), str) or not obj["model_dir"]:
            raise ProtocolError("'model_dir' must be a path")
        if obj.get("dtype", "float32") not in ("float32", "bfloat16"):
            raise ProtocolError(f"'dtype' must be float32 or bfloat16, got {obj.get('dtype')!r}")
        extra = obj.get("extra", {})
        if not isinstance(extra, dict):
            raise ProtocolError("'extra' must be an object of eSurge keywords")
        hbm = obj.get("hbm_utilization")
        if hbm is not None and not (isinstance(hbm, (int, float)) and 0 < hbm <= 1):
            raise ProtocolError(f"'hbm_utilization' must be in (0, 1], got {hbm!r}")
        prefix = obj.get("enable_prefix_caching")
        if prefix is not None and not isinstance(prefix, bool):
            raise ProtocolError("'enable_prefix_caching' must be true, false or null")
        return LoadCommand(
            model_dir=obj["model_dir"], max_model_len=_int(obj, "max_model_len", minimum=1),
            max_num_seqs=_int(obj, "max_num_seqs", minimum=1), dtype=obj.get("dtype", "float32"),
            attn_mechanism=str(obj.get("attn_mechanism") or DEFAULT_ATTENTION),
            max_num_batched_tokens=_int(obj, "max_num_batched_tokens", minimum=1, optional=True),
            page_size=_int(obj, "page_size", minimum=1, optional=True),
            hbm_utilization=hbm, enable_prefix_caching=prefix, extra=dict(extra))
    if cmd == "run":
        raw = obj.get("requests")
        if not isinstance(raw, list) or not raw:
            raise ProtocolError("'requests' must be a non-empty list")
        reqs, seen = [], set()
        for r in raw:
            if not isinstance(r, dict) or not isinstance(r.get("id"), str):
                raise ProtocolError(f"each request needs a string 'id', got {r!r}")
            if r["id"] in seen:
                raise ProtocolError(f"request id {r['id']!r} appears twice")
            seen.add(r["id"])
            ids = r.get("prompt_token_ids")
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise ProtocolError(f"request {r['id']!r}: 'prompt_token_ids' must be non-empty token ids")
            reqs.append(RunRequest(r["id"], tuple(ids), _int(r, "max_tokens", minimum=1)))
        return RunCommand(tuple(reqs), _int(obj, "max_concurrency", minimum=1, optional=True))
    raise ProtocolError(f"unknown command {cmd!r}; expected load, run or quit")


def encode(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":")) + "\n"


@dataclass(slots=True)
class _Live:
    """What the hook saw of one request: each step's new tokens, stamped as the engine hands them out."""
    submitted: float
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    signalled: bool = False


class ESurgeServer:
    """One eSurge engine and the closed loop that feeds it."""

    def __init__(self, cmd: LoadCommand) -> None:
        import jax.numpy as jnp
        from easydel.inference.esurge import eSurge

        kwargs: dict[str, Any] = dict(
            max_model_len=cmd.max_model_len, max_num_seqs=cmd.max_num_seqs,
            dtype=jnp.float32 if cmd.dtype == "float32" else jnp.bfloat16,
            attn_mechanism=cmd.attn_mechanism,
            # no margin held back from max_model_len: the caller sizes it for its workload, and
            # strict context makes a too-long request fail instead of being truncated or capped
            reserve_tokens=0, strict_context=True, auto_truncate_prompt=False, auto_cap_new_tokens=False,
            # "" (not None, which auto-detects one from the chat template): the bench reads token ids only
            tool_parser="", reasoning_parser="", silent_mode=True,
        )
        for key in ("max_num_batched_tokens", "page_size", "hbm_utilization", "enable_prefix_caching"):
            if getattr(cmd, key) is not None:
                kwargs[key] = getattr(cmd, key)
        kwargs.update(cmd.extra)
        t = time.perf_counter()
        self.engine = eSurge(model=cmd.model_dir, **kwargs)
        self.engine.initiate()
        self.startup_s = time.perf_counter() - t
        self.config = {k: (str(v) if k == "dtype" else v) for k, v in kwargs.items()}
        self.config["dtype"] = cmd.dtype
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._finished: queue.Queue[str] = queue.Queue()
        self._hook()

    def _hook(self) -> None:
        """Wrap the engine's output processing (called on its scheduler thread once per step with
        that step's new tokens): stamp every token as it arrives, then tell the loop which requests
        the engine has finished. eSurge's public RequestOutput updates token ids only every 16
        tokens or 40 ms (when it detokenizes), so it cannot give per-token times itself."""
        engine = self.engine
        original = engine._process_engine_outputs

        def stamped(engine_outputs: Any) -> None:
            now = time.perf_counter()
            with self._lock:
                for client in (engine_outputs or {}).values():
                    for out in client.outputs:
                        live = self._live.get(out.request_id)
                        if live is not None and out.new_token_ids:
                            live.tokens.extend(int(t) for t in out.new_token_ids)
                            live.times.extend([now] * len(out.new_token_ids))
            original(engine_outputs)
            with self._lock:
                for rid, live in self._live.items():
                    ro = engine._request_outputs.get(rid)
                    if not live.signalled and ro is not None and ro.finished:
                        live.signalled = True
                        self._finished.put(rid)

        engine._process_engine_outputs = stamped

    def _submit(self, r: RunRequest, t0: float) -> None:
        from easydel.inference.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=r.max_tokens, min_tokens=r.max_tokens, ignore_eos=True,
                                temperature=0.0, top_k=0, top_p=1.0)
        with self._lock:
            self._live[r.id] = _Live(time.perf_counter() - t0)
        # eSurge's public generate()/stream() take text and tokenize it; the bench's prompts are
        # token ids that need not survive a decode/encode round trip, so they go in as ids
        self.engine._add_request(r.id, "", params, prompt_token_ids=list(r.prompt_token_ids))

    def run(self, cmd: RunCommand, emit: Callable[[dict[str, Any]], None]) -> None:
        with self._lock:  # nothing left over from a run that failed half-way
            self._live.clear()
            self._finished = queue.Queue()
        t0 = time.perf_counter()
        waiting = deque(cmd.requests)
        cap = cmd.max_concurrency or len(waiting)
        in_flight: set[str] = set()
        while waiting or in_flight:
            while waiting and len(in_flight) < cap:
                r = waiting.popleft()
                self._submit(r, t0)
                in_flight.add(r.id)
            try:
                rid = self._finished.get(timeout=1.0)
            except queue.Empty:
                self.engine._raise_if_scheduler_failed()
                if not self.engine._scheduler_running:
                    raise RuntimeError("eSurge's scheduler stopped with requests in flight")
                continue
            in_flight.discard(rid)
            emit(self._result(rid, t0))
        emit({"event": "run_done", "duration_s": time.perf_counter() - t0})

    def _result(self, rid: str, t0: float) -> dict[str, Any]:
        with self._lock:
            live = self._live.pop(rid)
        ro = self.engine._request_outputs.pop(rid, None)
        comp = ro.outputs[0] if ro is not None and ro.outputs else None
        tokens = [int(t) for t in comp.token_ids] if comp is not None else live.tokens
        event = {"event": "done", "id": rid, "submitted_s": live.submitted,
                 "token_ids": tokens, "token_times_s": [t - t0 for t in live.times],
                 "finish_reason": getattr(comp, "finish_reason", None)}
        if live.tokens != tokens:  # the hook and the engine's own record disagree: say so
            event["hook_token_ids"] = live.tokens
        return event

    def close(self) -> None:
        # terminate() stops the scheduler but not the tokenizer/detokenizer worker processes, which
        # eSurge shuts down only in __del__ (not run at interpreter exit): they would outlive us
        for stop in (self.engine.terminate, self.engine._worker_manager.shutdown):
            try:
                stop()
            except Exception:
                traceback.print_exc()


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("easydel", "jax", "jaxlib", "flax", "ejkernel", "eformer", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "missing"
    return out


def _error(e: BaseException) -> dict[str, Any]:
    return {"event": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def main() -> int:
    # the protocol owns the real stdout; whatever easydel, jax or tqdm print goes to stderr
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(event: dict[str, Any]) -> None:
        proto.write(encode(event))
        proto.flush()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import easydel.inference.esurge  # noqa: F401  (the slow import, paid before "hello")
    except BaseException as e:
        emit({**_error(e), "import_failed": True})
        return 1
    emit({"event": "hello", "versions": _versions()})
    server: ESurgeServer | None = None
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                cmd = parse_command(line)
                if isinstance(cmd, QuitCommand):
                    break
                if isinstance(cmd, LoadCommand):
                    if server is not None:
                        raise ProtocolError("an engine is already loaded")
                    server = ESurgeServer(cmd)
                    import jax

                    emit({"event": "loaded", "startup_s": server.startup_s, "config": server.config,
                          "jax_backend": jax.default_backend()})
                elif server is None:
                    raise ProtocolError("'run' before 'load'")
                else:
                    server.run(cmd, emit)
            except Exception as e:
                emit(_error(e))
    finally:
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
