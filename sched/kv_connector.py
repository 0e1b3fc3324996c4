"""The KV connector seam: a request's KV computed elsewhere, loaded into this engine's blocks.

The shape is vLLM's KV connector, sized to what jaxserve needs, and it has two sides:
  - the scheduler side (`KVConnector`, called from schedule() and update(), pure Python) only
    decides: which loads start, which ended, which blocks are held for a receiver;
  - the runner side (`KVConnectorWorker.apply`) performs what those decisions need on the arena:
    each step's `SchedulerOutput.kv_connector_ops` (`KVConnectorOps`: loads whose bytes arrived,
    to write into their blocks; held blocks to gather for their receivers), at dispatch, in step
    order, after the step's swaps and before its copies and forward pass.
So the scheduler never touches a device array, and the runner never decides. The engine builds
the connector from its config (jaxserve/disagg/attach.py, `build_engine`); it serves both sides.

Receiving side (a decode engine), each `schedule()`:
  1. a waiting request with `remote_kv` gets its blocks (local prefix-cache hit first; only the
     blocks past it are loaded), leaves the queue as WAITING_FOR_REMOTE_KVS and its load starts
     (`start_load`): asynchronous, the step loop never waits for it.
  2. `poll()`: loads that ended. A load is applied only while its (request id, generation) is still
     live (`LiveLoads`): once a load is cancelled (deadline, abort) its blocks go back to the pool
     and may belong to another request, so a late or duplicate arrival is dropped, never written.
     A load that ended well goes in this step's `kv_connector_ops.loads`: the runner writes its
     bytes into its blocks before the step that computes the request's next token.
  3. a loaded request joins the running requests, while seats last, as one whose prompt is
     computed but its last token: this step computes that token and samples the first output,
     exactly as after a prefix-cache hit (so the outputs are the colocated engine's).
  A load that failed or ran past its deadline is handled by policy: `recompute` (the request goes
  back to the queue and prefills here) or `fail` (it ends; the engine reports it UNAVAILABLE).

Sending side (a prefill engine): a request with `kv_send` that ends normally does not free its
blocks: `hold()` takes them (with their prefix-cache nodes) under a lease, and the connector gives
them back through `Scheduler.free_held_blocks` when the receiver acknowledges or the lease expires.
The held blocks go in the next step's `kv_connector_ops.saves`: the runner gathers them for the
lease (a step with no request is dispatched for it: `has_unfinished_requests` counts pending ops).
Held blocks count as in use, so a prefill engine whose receivers are slow stops admitting rather
than overwriting what was promised.

The prefix cache's host tier (prefix_cache.py) uses the same split through the step's swap lists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from jaxserve.sched.admission import Admission
from jaxserve.sched.kv_cache_manager import KVCacheManager, cdiv
from jaxserve.sched.request import Request, RequestStatus
from jaxserve.sched.request_queue import WaitingQueue
from jaxserve.sched.scheduler_config import SchedulerConfig

LOAD_FAILURE_POLICIES = ("recompute", "fail")


class KVLoadFailed(RuntimeError):
    """A request's remote KV could not be loaded and the policy is `fail` (UNAVAILABLE on the wire)."""


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """Where a request's prompt KV waits: a sending engine's lease on its blocks."""

    peer: str            # host:port of the engine that holds the blocks
    transfer_id: str     # the lease's name there
    generation: int      # the lease's generation: a pull for another generation is refused there
    num_tokens: int      # tokens whose K/V the sender computed (the prompt)


@dataclass(frozen=True, slots=True)
class KVLoad:
    """One load the scheduler asks for: the sender's logical blocks [first_block, first_block +
    len(dst_block_ids)) into this engine's `dst_block_ids` (remapped: never the sender's ids)."""

    request_id: str
    generation: int      # this engine's number for the load; results carry it back
    remote: RemoteKV
    first_block: int
    dst_block_ids: tuple[int, ...]
    num_tokens: int      # the request's computed tokens once the load is in
    tokens_sha256: bytes = b""   # tokens_digest of those tokens: the sender checks its KV is theirs


@dataclass(frozen=True, slots=True)
class KVLoadResult:
    request_id: str
    generation: int
    ok: bool
    reason: str = ""     # why it failed: "timeout", "unavailable", "not_found", "layout", ...
    detail: str = ""


@dataclass(frozen=True, slots=True)
class HeldBlocks:
    """A finished request's blocks kept for a receiver (sending side)."""

    request_id: str
    block_ids: tuple[int, ...]
    nodes: tuple = ()     # their prefix-cache nodes, released with them
    num_tokens: int = 0   # tokens whose K/V the blocks hold
    token_ids: tuple[int, ...] = ()   # those tokens: a pull names the ones it expects (tokens_digest)


def tokens_digest(token_ids) -> bytes:
    """sha256 of token ids as little-endian int32: what a receiver expects the KV to be of."""
    import hashlib
    import struct

    ids = list(token_ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).digest()


@dataclass(frozen=True, slots=True)
class KVConnectorOps:
    """The runner side's work for one step, decided by the scheduler side."""

    loads: tuple[KVLoad, ...] = ()        # ended well: write their bytes into dst_block_ids
    saves: tuple[HeldBlocks, ...] = ()    # held for a receiver: gather their blocks for the lease

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


class KVConnector(Protocol):
    """The scheduler side: decisions only (never a device array)."""

    can_send: bool   # it can hold finished kv_send requests' blocks for receivers
    can_load: bool   # it can load requests' KV from elsewhere (remote_kv)

    def num_matched_tokens(self, request: Request) -> int: ...   # side-effect free: tokens it can supply
    def start_load(self, load: KVLoad) -> None: ...
    def poll(self) -> list[KVLoadResult]: ...   # an ok load's bytes wait for its op on the runner side
    def cancel_load(self, request_id: str, generation: int) -> None: ...   # also drops bytes not applied
    def release_remote(self, remote: RemoteKV) -> None: ...   # the sender's blocks are not needed
    def hold(self, held: HeldBlocks) -> None: ...   # grant the lease; its gather is a save op
    def wait(self, timeout: float) -> None: ...     # block until a load may have ended (an idle step loop)


class KVConnectorWorker(Protocol):
    """The runner side: performs a step's ops on the arena, at dispatch."""

    def apply(self, ops: KVConnectorOps) -> None: ...


class LiveLoads:
    """The loads in flight by request id, each with its generation. `take` and `cancel` remove a
    load only when the generation matches, so a result that arrives after its load was cancelled
    (or a second result of the same load) finds nothing and is dropped."""

    def __init__(self) -> None:
        self._loads: dict[str, KVLoad] = {}
        self.num_stale = 0   # results dropped by the generation check

    def add(self, load: KVLoad) -> None:
        if load.request_id in self._loads:
            raise ValueError(f"request {load.request_id!r} already has a load in flight")
        self._loads[load.request_id] = load

    def get(self, request_id: str, generation: int) -> KVLoad | None:
        load = self._loads.get(request_id)
        return load if load is not None and load.generation == generation else None

    def take(self, request_id: str, generation: int) -> KVLoad | None:
        load = self.get(request_id, generation)
        if load is None:
            self.num_stale += 1
            return None
        del self._loads[request_id]
        return load

    def cancel(self, request_id: str, generation: int) -> KVLoad | None:
        load = self.get(request_id, generation)
        if load is not None:
            del self._loads[request_id]
        return load

    def __iter__(self):
        return iter(list(self._loads.values()))

    def __len__(self) -> int:
        return len(self._loads)


class KVLoading:
    """The scheduler's component for KV that comes from elsewhere or leaves for a receiver: it owns
    the connector (None: off), the requests whose KV is on its way, the step's connector ops and
    the counters; the scheduler (scheduler.py) owns the queue and the running list it is handed
    and ends the requests it reports failed."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, admission: Admission,
                 lora_slots=None) -> None:
        self.config = config
        self.kv = kv
        self.admission = admission
        self.connector: KVConnector | None = None
        self.failure_policy = "recompute"
        self._generations = itertools.count(1)
        self._loading: dict[str, Request] = {}   # WAITING_FOR_REMOTE_KVS, holding blocks
        self._load_of: dict[str, KVLoad] = {}    # their loads (the op once the bytes are in)
        self._loaded: list[Request] = []         # loaded, waiting for a seat
        self.errors: list[tuple[str, str]] = []  # (request id, why): failed by policy "fail", for the engine
        self.num_started = 0
        self.num_done = 0
        self.fallbacks: dict[str, int] = {}      # reason -> requests recomputed or failed
        self.num_stale_results = 0
        self._ops_loads: list[KVLoad] = []       # the next step's runner-side work (KVConnectorOps)
        self._ops_saves: list[HeldBlocks] = []
        # LoRA slots (lora_slots.py): a loaded request under an adapter is
        # seated with its adapter's slot, or waits for one
        self.lora_slots = lora_slots

    def attach(self, connector: KVConnector, failure_policy: str = "recompute") -> None:
        if failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"failure_policy={failure_policy!r} must be one of {LOAD_FAILURE_POLICIES}")
        self.connector = connector
        self.failure_policy = failure_policy

    # ---- what the scheduler and the engine read ----
    def take_ops(self) -> KVConnectorOps | None:
        """The runner-side work decided since the last step (schedule() puts it in its output)."""
        if not (self._ops_loads or self._ops_saves):
            return None
        ops = KVConnectorOps(tuple(self._ops_loads), tuple(self._ops_saves))
        self._ops_loads, self._ops_saves = [], []
        return ops

    @property
    def has_ops(self) -> bool:
        return bool(self._ops_loads or self._ops_saves)

    def take_errors(self) -> list[tuple[str, str]]:
        errors, self.errors = self.errors, []
        return errors

    def requests(self) -> list[Request]:
        """Requests holding blocks outside the queue and the running list: loading, or loaded
        and waiting for a seat."""
        return list(self._loading.values()) + self._loaded

    @property
    def num_in_flight(self) -> int:
        return len(self._loading) + len(self._loaded)

    def only_loading(self, num_live: int) -> bool:
        """Every live request is a load in flight: a step would have nothing to compute."""
        return bool(self._loading) and len(self._loading) == num_live

    # ---- a step ----
    def step(self, waiting: WaitingQueue, running: list[Request]) -> list[Request]:
        """At the top of schedule(): start loads, apply ended ones (their writes become this step's
        ops), seat loaded requests. Returns the requests that failed by policy (the scheduler
        ends them)."""
        failed: list[Request] = []
        if self.connector is None:
            return failed
        for req in [r for r in waiting if r.remote_kv is not None and r.status is RequestStatus.WAITING]:
            if not self._start(req, waiting, running):
                break   # no room: the queue's order holds, later ones wait too
        for res in self.connector.poll():
            req = self._loading.get(res.request_id)
            if req is None or req.kv_load_generation != res.generation:
                self.num_stale_results += 1    # cancelled meanwhile: the blocks may be someone else's
                if res.ok:
                    self.connector.cancel_load(res.request_id, res.generation)   # its bytes are never written
                continue
            del self._loading[res.request_id]
            load = self._load_of.pop(res.request_id)
            if res.ok:
                req.num_computed_tokens = req.kv_load_tokens
                self.num_done += 1
                self._ops_loads.append(load)
                self._loaded.append(req)
            elif self._fallback(req, res.reason, res.detail, waiting):
                failed.append(req)
        while self._loaded and len(running) < self.config.max_num_seqs:
            req = self._loaded[0]
            if self.lora_slots is not None and not self.lora_slots.can_admit(req):
                break     # every slot is held by running requests: seated once one frees
            self._loaded.pop(0)
            req.status = RequestStatus.RUNNING
            req.remote_kv = None
            running.append(req)
            if self.lora_slots is not None:
                self.lora_slots.acquire(req)
        return failed

    def _start(self, req: Request, waiting: WaitingQueue, running: list[Request]) -> bool:
        """Allocate req's blocks (a local prefix hit first) and start loading the rest."""
        remote = req.remote_kv
        # the last prompt token is computed here: its logits sample the first output
        want = min(self.connector.num_matched_tokens(req), req.num_prompt_tokens) - 1
        prefix = self.kv.find_cached_prefix(req)
        if want <= prefix.num_tokens:   # all of it is cached here already: nothing to load
            req.remote_kv = None
            self.connector.release_remote(remote)
            return True
        if not self.admission.admits(req, prefix, running):
            return False
        copies: list[tuple[int, int]] = []
        if not self.kv.allocate_slots(req, want - prefix.num_tokens, copies, prefix, self.admission.reserve(running)):
            return False
        assert not copies, "a load starts at a block boundary: nothing to copy"
        waiting.remove(req)
        req.num_cached_tokens = min(prefix.num_tokens, req.num_prompt_tokens)
        self.kv.record_lookup(req, prefix)
        bs = self.config.block_size
        first = prefix.num_tokens // bs
        req.kv_load_generation = next(self._generations)
        req.kv_load_tokens = want
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loading[req.request_id] = req
        self.num_started += 1
        load = KVLoad(req.request_id, req.kv_load_generation, remote, first,
                      tuple(req.block_ids[first:cdiv(want, bs)]), want, tokens_digest(req.prompt_token_ids[:want]))
        self._load_of[req.request_id] = load
        self.connector.start_load(load)
        return True

    def _fallback(self, req: Request, reason: str, detail: str, waiting: WaitingQueue) -> bool:
        """A load failed: free its blocks; back to the queue to prefill here (recompute), or (fail)
        queued only to be ended by the scheduler: returns True then."""
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.remote_kv = None
        req.status = RequestStatus.WAITING
        waiting.push(req, req.queue_key)
        if self.failure_policy == "fail" or reason == "layout":   # a mismatch is never hidden
            self.errors.append((req.request_id, f"KV load failed ({reason}): {detail}".rstrip(": ")))
            return True
        return False

    def on_finish(self, req: Request, reason: str) -> bool:
        """Called by the scheduler before it frees an ending request's blocks. Returns True when
        the blocks were taken care of here (freed, or held for a receiver)."""
        if req in self._loaded:   # loaded, not seated yet
            self._loaded.remove(req)
            self.kv.free(req)
            return True
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            # an abort while loading: the load is cancelled first, so its late arrival is dropped
            del self._loading[req.request_id]
            self._load_of.pop(req.request_id, None)
            self.connector.cancel_load(req.request_id, req.kv_load_generation)
            self.kv.free(req)
            return True
        if req.kv_send and reason != "abort" and self.connector is not None:
            block_ids, nodes = self.kv.hold(req)
            n = min(req.num_computed_tokens, req.num_tokens)
            held = HeldBlocks(req.request_id, tuple(block_ids), tuple(nodes), n, tuple(req.all_token_ids[:n]))
            self.connector.hold(held)
            self._ops_saves.append(held)
            return True
        return False

    def free_held_blocks(self, held: HeldBlocks) -> None:
        """The receiver is done with blocks `hold()` took (or their lease expired)."""
        self.kv.free_held(list(held.block_ids), list(held.nodes))
