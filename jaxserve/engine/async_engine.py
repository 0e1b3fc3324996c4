"""AsyncEngine: the Engine's step loop in its own thread, streamed to asyncio consumers.

The Engine is not thread-safe, so one thread (the step thread) owns it. Asyncio code never calls
it: it queues commands (add, abort, call) that the step thread applies between steps, and the step
thread hands each step's outputs back to the event loop with `loop.call_soon_threadsafe`, where
they land in one asyncio queue per request. The event loop therefore never waits on a step, and a
step never waits on a slow consumer.

    aengine = AsyncEngine(engine)
    async for out in aengine.generate("Hello", SamplingParams(max_tokens=8)):
        print(out.outputs[0].text, end="")          # DELTA outputs by default

A request passes the engine's door (its InputProcessor: tokenizing, every limit) in a small pool
of tokenizer threads, never on the step thread (the tokenizer releases the GIL while it works), so
a long prompt delays only itself; the step thread only queues what passed. A text longer than any
prompt that fits max_model_len (`max_prompt_chars`) is refused before it is tokenized, and token
ids that could not fit before they are scanned.

Leaving the `async for` early (break, an exception, task cancellation) aborts the request: the
abort is applied before the next step, so its KV blocks are free as soon as the current step ends.
If a step raises, every in-flight request fails with EngineDeadError, the engine is marked
unhealthy, and later calls fail at once: nothing waits forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Iterable

from jaxserve.embedding_outputs import EmbeddingRequestOutput
from jaxserve.engine.input_processor import EngineRequest
from jaxserve.engine.output_stream import OutputStream
from jaxserve.engine.stats import EngineStats
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.refusals import ContextLengthExceeded
from jaxserve.sampling_params import OutputKind, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop crashed; the engine accepts no more work (the cause is `__cause__`)."""


class EngineStoppedError(RuntimeError):
    """The engine was shut down; it accepts no more work."""


class EmbeddingAborted(RuntimeError):
    """An embedding request ended before its embedding was complete (aborted, or shut down)."""


# how often an idle step thread looks again whether the engine's idle work can run (its background
# warm-up still running, say); only while there is some (Engine.idle_work_pending)
IDLE_POLL_S = 0.5
_ABORTED = object()   # queued to a stream whose request was aborted by `abort()` or shutdown


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    request: EngineRequest     # validated (and tokenized) at the door, off the step thread
    arrival_time: float
    kv_transfer: Any = None    # disaggregated serving: "send" or a RemoteKV (Engine.add_processed)


@dataclass(frozen=True, slots=True)
class _Abort:
    request_ids: tuple[str, ...]
    notify: bool          # True: tell the streams (an external abort); False: the consumer already left


@dataclass(frozen=True, slots=True)
class _Call:
    fn: Callable[[Any], Any]
    future: asyncio.Future


@dataclass(frozen=True, slots=True)
class _Stop:
    request_ids: tuple[str, ...]   # streams still live: aborted in the engine before the thread ends


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the step thread last published; readable from any thread (Prometheus scrapes)."""

    stats: EngineStats
    finished_by_reason: dict[str, int]
    taken_at: float = field(default_factory=time.monotonic)   # stats.lifecycle.uptime_s ages from here


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token of this vocabulary can stand for: the longest vocabulary
    string (byte-level BPE spells each byte as one character, SentencePiece a space as one), so a
    text of C characters is at least C / this many tokens. None without a vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        return max((len(t) for t in get_vocab()), default=None)
    except Exception:   # noqa: BLE001 - a tokenizer without a usable vocabulary: no early bound
        log.warning("cannot read the tokenizer's vocabulary; long prompts are only refused after tokenizing")
        return None


class AsyncEngine:
    def __init__(self, engine, *, on_dead: Callable[[BaseException], None] | None = None,
                 thread_name: str = "jaxserve-step-loop", tokenizer_threads: int = 2):
        self.engine = engine
        self._on_dead = on_dead
        self._thread_name = thread_name
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=tokenizer_threads,
                                                  thread_name_prefix="jaxserve-tokenizer")
        self.longest_token_chars = longest_token_chars(engine.tokenizer) if engine.tokenizer is not None else None
        # no prompt that fits max_model_len is longer: at most max_model_len - 1 tokens of the longest kind
        self.max_prompt_chars = (None if self.longest_token_chars is None
                                 else (engine.max_model_len - 1) * self.longest_token_chars)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}       # event-loop side only
        self._calls: set[asyncio.Future] = set()           # event-loop side only
        self._pause_waiters: list[asyncio.Future] = []     # step-thread side: pause("wait") calls
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self.snapshot = EngineSnapshot(engine.stats(), dict(engine.finished_by_reason))

    # -- state -------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._error is None and not self._stopped

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def num_active(self) -> int:
        """Requests with a live stream (added, not yet finished or abandoned)."""
        return len(self._streams)

    def active_request_ids(self) -> list[str]:
        return list(self._streams)

    def start(self) -> None:
        """Bind to the running event loop and start the step thread (generate() does it too)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def _check_open(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine failed earlier and accepts no requests: {self._error!r}")
        if self._stopped:
            raise EngineStoppedError("the engine is shut down")
        self.start()

    # -- the asyncio side --------------------------------------------------------------------
    async def generate(self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None,
                       priority: int = 0, arrival_time: float | None = None,
                       kv_transfer: Any = None, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. A bad request raises ValueError (NotImplementedError for what
        the engine lacks, the scheduler's Overloaded for a full waiting queue) from the first iteration.
        `arrival_time` (time.perf_counter(); default: now) starts the request's latency metrics."""
        self._check_open()
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        params = SamplingParams(output_kind=OutputKind.DELTA) if params is None else params
        request_id = uuid.uuid4().hex if request_id is None else str(request_id)
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use")
        q = OutputStream(appends=isinstance(params, SamplingParams) and params.output_kind is OutputKind.DELTA
                         and params.n == 1)
        self._streams[request_id] = q        # registered before tokenizing, so a crash or shutdown finds it
        added = done = False
        last: RequestOutput | None = None
        try:
            text = _prompt_text(prompt)
            if text is not None:
                self.check_prompt_chars(len(text))
            else:
                self._check_prompt_token_count(prompt)
            door = self.engine.input_processor
            request = await self._off_step_thread(door.process, prompt, params, priority=priority,
                                                  lora_request=lora_request)
            if request.lora_request is not None:    # its files read here, not on the step thread
                read = await self._off_step_thread(self.engine.read_lora, request.lora_request, for_request=True)
                if read is not None:
                    request = dataclasses.replace(request, lora_read=read)
            if self._error is None and not self._stopped:   # else the queue holds the error or the abort
                self._commands.put(_Add(request_id, request, arrival_time, kv_transfer))
                added = True
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item is _ABORTED:
                    done = True
                    yield _aborted_output(request_id, last, params.output_kind)
                    return
                last = item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if self._streams.get(request_id) is q:
                del self._streams[request_id]
            if added and not done and self._error is None and not self._stopped:
                # the consumer left early (cancelled, broke out, raised): free the request now
                self._commands.put(_Abort((request_id,), notify=False))

    async def embed(self, prompt: Any, params: PoolingParams | None = None, *, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> EmbeddingRequestOutput:
        """A prompt's embedding (LLM.embed's, one prompt): through `generate`'s stream, whose one
        output is the EmbeddingRequestOutput. Refusals raise as generate's do; an abort (abort(),
        shutdown) raises EmbeddingAborted."""
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling params must be a PoolingParams, got {type(params).__name__}")
        last = None
        async for out in self.generate(prompt, params, request_id=request_id, priority=priority,
                                       arrival_time=arrival_time):
            last = out
        if not isinstance(last, EmbeddingRequestOutput):
            raise EmbeddingAborted("the embedding request was aborted before its embedding was complete")
        return last

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse, before tokenizing, a text too long for any prompt that fits max_model_len."""
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            m = self.engine.max_model_len
            raise ContextLengthExceeded(
                f"the prompt has {num_chars} characters, more than the {limit} that fit max_model_len={m}: "
                f"at most {m - 1} prompt tokens of at most {self.longest_token_chars} characters each")

    def _check_prompt_token_count(self, prompt: Any) -> None:
        """Refuse token ids too many to run even with one output token before they are scanned."""
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else None
        if isinstance(ids, (list, tuple)) and ids:
            self.engine.input_processor.limits.check(len(ids), 1)

    async def run_tokenizer(self, fn: Callable[[Any], Any]) -> Any:
        """fn(tokenizer) in a tokenizer thread: never on the step thread or the event loop."""
        return await self._off_step_thread(fn, self.engine.tokenizer)

    async def run_off_step_thread(self, fn: Callable, *args, **kwargs) -> Any:
        """fn(*args, **kwargs) on the door's worker threads (tokenizing, reading adapter files):
        never on the step thread, never on the event loop."""
        return await self._off_step_thread(fn, *args, **kwargs)

    async def _off_step_thread(self, fn: Callable, *args, **kwargs) -> Any:
        if self._stopped:
            raise EngineStoppedError("the engine is shut down")
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, call)

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests; their streams end with a finish_reason "abort" output."""
        ids = (request_ids,) if isinstance(request_ids, str) else tuple(request_ids)
        if self._error is None and not self._stopped and ids:
            await self.call(lambda engine: self._apply_abort(engine, _Abort(ids, notify=True)))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the step thread between two steps and return its result. Once the
        step thread is gone (crashed, stopped) fn runs here: nothing else touches the engine."""
        if self._error is not None or self._stopped:
            return fn(self.engine)
        self.start()
        fut = asyncio.get_running_loop().create_future()
        self._calls.add(fut)
        self._commands.put(_Call(fn, fut))
        try:
            return await fut
        finally:
            self._calls.discard(fut)

    # LoRA adapters (Engine.add_lora and friends), run on the step thread between steps
    async def add_lora(self, lora_request) -> bool:
        read = await self._off_step_thread(self.engine.read_lora, lora_request)   # its files, read here
        return await self.call(lambda engine: engine.add_lora(lora_request, read))

    async def remove_lora(self, name_or_id: str | int) -> bool:
        return await self.call(lambda engine: engine.remove_lora(name_or_id))

    async def list_loras(self) -> list:
        return await self.call(lambda engine: engine.list_loras())

    async def stats(self) -> EngineStats:
        return await self.call(lambda engine: engine.stats())

    # -- weights and pause (docs/rl.md) ------------------------------------------------------
    async def update_weights(self, params: Any, *, version: int | str | None = None):
        """Engine.update_weights between two steps (the step thread does it; the event loop
        never waits on the placement). Returns its WeightUpdate."""
        return await self.call(lambda engine: engine.update_weights(params, version=version))

    async def update_weights_from_disk(self, path: str, *, version: int | str | None = None):
        """Load a checkpoint's tensors (engine/weight_update.py `checkpoint_tensors`) in a
        worker thread, the steps running meanwhile, then update_weights with them."""
        from jaxserve.engine.weight_update import checkpoint_tensors

        self._check_open()
        tensors = await asyncio.to_thread(checkpoint_tensors, path)
        return await self.update_weights(tensors.items(), version=version)

    async def pause(self, mode: str = "abort") -> list[str]:
        """Engine.pause between two steps; returns the ids aborted. mode "wait" returns once the
        requests in flight have finished (their streams end normally). Streams of requests held
        ("keep", or added while paused) stay open until resume() lets them run."""
        self._check_open()
        paused = asyncio.get_running_loop().create_future()
        self._calls.add(paused)    # a crash fails it, as every call
        try:
            aborted = await self.call(lambda engine: self._pause_on_thread(engine, mode, paused))
            await paused
            return aborted
        finally:
            self._calls.discard(paused)

    async def resume(self) -> None:
        """Step again; the requests held while paused run now."""
        await self.call(self._resume_on_thread)

    # -- sleep and wake up (runner/sleep.py, docs/rl.md) -------------------------------------
    async def sleep(self, level: int = 1):
        """Engine.sleep between two steps (refused while requests run: pause() first); returns its
        SleepReport. Requests added while asleep wait, their streams open, until wake_up()."""
        self._check_open()
        return await self.call(lambda engine: engine.sleep(level))

    async def wake_up(self):
        """Engine.wake_up between two steps; returns its WakeUpReport. Waiting requests run then."""
        self._check_open()
        return await self.call(lambda engine: engine.wake_up())

    def _pause_on_thread(self, engine, mode: str, paused: asyncio.Future) -> list[str]:
        aborted = engine.pause(mode)
        drained = engine.take_drained()
        if drained:
            self._post(self._deliver, drained)
        for rid in aborted:
            self._post(self._deliver_one, rid, _ABORTED)
        self._pause_waiters.append(paused)
        self._settle_pause_waiters(engine)
        return aborted

    def _resume_on_thread(self, engine) -> None:
        for rid, err in engine.resume():
            self._post(self._deliver_one, rid, err)
        self._settle_pause_waiters(engine, resumed=True)

    def _settle_pause_waiters(self, engine, resumed: bool = False) -> None:
        """Tell the pause() calls waiting that the engine is paused (or was resumed first)."""
        if self._pause_waiters and (engine.paused or resumed):
            for fut in self._pause_waiters:
                self._post(_settle, fut, None, None)
            self._pause_waiters = []

    async def shutdown(self) -> None:
        """Abort every live request (their streams end with "abort"), stop the step thread."""
        if self._stopped:
            return
        self._stopped = True
        self._tokenizer_pool.shutdown(wait=False)   # what is tokenizing finishes; its stream gets the abort
        live = tuple(self._streams)
        for rid in live:
            self._streams[rid].put(_ABORTED)
        if self._thread is not None:
            self._commands.put(_Stop(live))
            await asyncio.to_thread(self._thread.join)
        self.engine.close()

    # -- the step thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # block while idle (polling while the engine has idle work: run_idle_work), otherwise
                # take whatever arrived during the last step
                cmds = []
                if not engine.has_unfinished_requests():
                    if not engine.idle_work_pending:
                        cmds = [self._commands.get()]
                    else:
                        try:
                            cmds = [self._commands.get(timeout=IDLE_POLL_S)]
                        except queue.Empty:
                            if engine.run_idle_work():
                                self._publish_snapshot()
                            continue
                while True:
                    try:
                        cmds.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    if isinstance(cmd, _Stop):
                        engine.abort(cmd.request_ids)
                        self._publish_snapshot()
                        self._refuse_remaining()
                        return
                    self._apply(engine, cmd)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:
                        self._post(self._deliver, outputs)
                    for rid, err in engine.take_request_errors():
                        self._post(self._deliver_one, rid, err)
                    self._settle_pause_waiters(engine)
                drained = engine.take_drained()   # a step collected by an update between steps
                if drained:
                    self._post(self._deliver, drained)
                self._publish_snapshot()
        except BaseException as e:   # noqa: BLE001 - any failure must fail the requests, not hang them
            self._die(e)

    def _apply(self, engine, cmd) -> None:
        if isinstance(cmd, _Add):
            try:
                engine.add_processed(cmd.request_id, cmd.request, arrival_time=cmd.arrival_time,
                                     **({"kv_transfer": cmd.kv_transfer} if cmd.kv_transfer is not None else {}))
            except Exception as e:   # a bad request fails alone; the engine is fine
                self._post(self._deliver_one, cmd.request_id, e)
        elif isinstance(cmd, _Abort):
            self._apply_abort(engine, cmd)
        elif isinstance(cmd, _Call):
            try:
                result = cmd.fn(engine)
            except Exception as e:
                self._post(_settle, cmd.future, None, e)
            else:
                self._post(_settle, cmd.future, result, None)

    def _apply_abort(self, engine, cmd: _Abort) -> None:
        engine.abort(cmd.request_ids)
        if cmd.notify:
            for rid in cmd.request_ids:
                self._post(self._deliver_one, rid, _ABORTED)

    def _refuse_remaining(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call):
                self._post(_settle, cmd.future, None, EngineStoppedError("the engine is shut down"))

    def _publish_snapshot(self) -> None:
        self.snapshot = EngineSnapshot(self.engine.stats(), dict(self.engine.finished_by_reason))

    def _die(self, e: BaseException) -> None:
        log.exception("the engine's step loop crashed; failing every in-flight request")
        self._error = e
        err = EngineDeadError(f"the engine's step loop crashed: {type(e).__name__}: {e}")
        err.__cause__ = e
        self._post(self._fail_all, err)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the event loop is closed: nobody is left to tell
            pass

    # -- back on the event loop --------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put(out)

    def _deliver_one(self, request_id: str, item) -> None:
        q = self._streams.get(request_id)
        if q is not None:
            q.put(item)

    def _fail_all(self, err: EngineDeadError) -> None:
        for q in self._streams.values():
            q.put(err)
        for fut in list(self._calls):
            if not fut.done():
                fut.set_exception(err)
        if self._on_dead is not None:
            self._on_dead(err)


def _prompt_text(prompt: Any) -> str | None:
    """The text of a text prompt (a string, or a dict with "prompt"); None otherwise."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():   # the caller was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _aborted_output(request_id: str, last: RequestOutput | None, kind: OutputKind) -> RequestOutput:
    """The final output of an aborted stream: nothing new for DELTA, everything so far otherwise
    (n > 1 outputs are cumulative whatever the kind: every sample keeps its tokens)."""
    if last is None:
        return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], finish_reason="abort")], True)
    keep = kind is not OutputKind.DELTA or len(last.outputs) > 1
    completions = [replace(c, text=c.text if keep else "", token_ids=list(c.token_ids) if keep else [],
                           finish_reason=c.finish_reason or "abort", stop_reason=c.stop_reason,
                           logprobs=(list(c.logprobs) if keep and c.logprobs is not None else None))
                   for c in last.outputs]
    return RequestOutput(request_id, last.prompt, last.prompt_token_ids, completions, True,
                         num_cached_tokens=last.num_cached_tokens, metrics=last.metrics)
