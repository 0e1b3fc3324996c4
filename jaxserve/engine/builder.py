"""Building an Engine from an EngineConfig: checkpoint -> params -> KV arena -> compiled buckets.

All compilation happens here, before the engine accepts a request; the engine counts only the
compilations of its own calls, so `num_compilations_after_warmup` measures the serving path alone.

Start-up is timed phase by phase (`engine.startup_timings`, logged at INFO), and what a phase
derives only from its inputs is kept under `cache_dir` for the next start: the checkpoint identity
and a GGUF's dequantized form (jaxserve.checkpoints), the serialized executables
(runner/executables.py) and the calibration timings (runner/calibration.py). With `warm_up="all"`
every step is loaded and run once before the engine is returned; with "none" nothing is, and
`prepare_for_requests` warms what a known set of first requests can need.

`build_custom_engine` starts from a model defined outside jaxserve (models/custom.py,
docs/custom_models.md) and its params instead of a checkpoint; from the params on, both paths
are one (`_serve`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import uuid
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.checkpoints import Checkpoint, load_checkpoint
from jaxserve.config import EngineConfig
from jaxserve.engine.chunk_policy import DECODE_CONTEXT, PROVISIONAL, resolve_chunk_policy
from jaxserve.engine.deferred_calibration import DeferredCalibration
from jaxserve.engine.draft_model import build_draft_runner
from jaxserve.engine.host_gc import pace_collector
from jaxserve.engine.draft_proposer import DraftModelProposer
from jaxserve.engine.chat_template import apply_chat_template_override, default_chat_template
from jaxserve.engine.engine import Engine
from jaxserve.engine.startup_calibration import StartupCalibration
from jaxserve.engine.startup_timings import PhaseClock, StartupTimings
from jaxserve.engine.step_features import step_features
from jaxserve.engine import warm_start
from jaxserve.lora import engine_lora as lora_engine
from jaxserve.models import custom
from jaxserve.models.config import ModelConfig
from jaxserve.models.custom import CustomModel
from jaxserve.models.params import layout_of, params_from_hf
from jaxserve.parallel.distributed import HostConfig, join, lead
from jaxserve.parallel.layout import HeadLayout
from jaxserve.parallel.experts import check_expert_sizes
from jaxserve.parallel.mesh import AXES, DATA_AXIS, MODEL_AXIS, as_moe_mesh, make_mesh, make_moe_mesh
from jaxserve.parallel.sharding import place_params, to_shard_major
from jaxserve.quant.prepare import prepare as prepare_quantization
from jaxserve.quant.prepare import quant_request
from jaxserve.runner.buckets import (RunnerShapes, default_decode_buckets, default_decode_only_buckets,
                                    default_prefill_buckets, max_prefill_tiles)
from jaxserve.runner.calibration import CalibrationCache, CalibrationKey, CalibrationMiss, Calibrator
from jaxserve.runner.executables import ExecutableCache
from jaxserve.runner.kv_arena import plan_arena
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.warmup import buckets_for_requests, warm_up
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.scheduler_config import SchedulerConfig

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 1 << 30
MAX_DEFAULT_MODEL_LEN = 8192


def resolve_dtype(name: str) -> str:
    if name == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return name


# jaxserve keeps its steps and samplers in its own cache and writes them no more to XLA's
# (runner/executables.py: what XLA loads from its cache cannot be kept). Entries that earlier
# versions wrote there for the same programs would be hit on every start and never kept, so XLA's
# cache lives in a subfolder of its own per layout.
XLA_CACHE_LAYOUT = "v2"


def enable_compilation_cache(path: str | None) -> None:
    if not path:
        return
    path = os.path.join(path, XLA_CACHE_LAYOUT)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def runner_shapes(config: EngineConfig, max_model_len: int) -> RunnerShapes:
    compiled, seats = config.compilation, config.scheduler.max_num_seqs
    budget = config.scheduler.max_num_batched_tokens
    tiles = max_prefill_tiles(budget, compiled.prefill_tile)
    decode = compiled.decode_buckets or default_decode_buckets(seats)
    prefill = compiled.prefill_buckets or default_prefill_buckets(tiles)
    # explicit decode_buckets alone also serve decode-only steps (what a test that pins them expects)
    # speculation's guesses are extra decode rows: decode-only steps of up to twice the seats
    # (its planner measures what they cost and stops guessing where they do not pay)
    spec_rows = 2 * seats if config.speculative_config is not None else seats
    decode_only = compiled.decode_only_buckets or (
        decode if compiled.decode_buckets else default_decode_only_buckets(spec_rows))
    for name, rows in (("decode_buckets", decode), ("decode_only_buckets", decode_only)):
        if rows[-1] < seats:
            raise ValueError(f"{name}={rows} must reach max_num_seqs={seats}")
    if prefill[-1] < tiles:
        raise ValueError(f"prefill_buckets={prefill} must reach {tiles} tiles: a step of "
                         f"max_num_batched_tokens={budget} in tiles of {compiled.prefill_tile} can need that many")
    return RunnerShapes(
        block_size=config.cache.block_size,
        max_model_len=max_model_len,
        prefill_tile=compiled.prefill_tile,
        decode_buckets=decode,
        prefill_buckets=prefill,
        decode_only_buckets=decode_only,
    )


def fused_sampler(config: EngineConfig) -> bool:
    """Whether the steps sample too (compilation.fuse_sampler; default: on an accelerator only)."""
    fuse = config.compilation.fuse_sampler
    return jax.default_backend() != "cpu" if fuse is None else fuse


def build_engine(config: EngineConfig, *, checkpoint: Checkpoint | None = None, progress: bool = True,
                 share_runner_of: Engine | None = None, mesh: Mesh | None = None) -> Engine:
    """Load, compile and wire an Engine. `share_runner_of` reuses another engine's compiled runner
    and arena (same model and shapes) under a new scheduler: tests use it to create KV pressure
    with a capped pool without compiling again. `mesh`: the engine's ("data", "model") mesh over
    devices the caller chose (parallel/mesh.py `engine_mesh`; LLM(mesh=...)), its "model" axis
    tensor_parallel_size long; None: the first tensor_parallel_size devices."""
    if share_runner_of is not None:
        return _with_connector(_engine_on_shared_runner(config, share_runner_of), config)
    _check_caller_mesh(mesh, config)
    # several hosts: join them first (jax.distributed must start before jax's backend does)
    parallel = config.parallel
    host_config = HostConfig.resolve(parallel.num_hosts, parallel.host_rank, parallel.coordinator_address,
                                     parallel.host_timeout_s)
    hosts = join(host_config) if host_config is not None else None
    clock = PhaseClock()
    enable_compilation_cache(config.compilation.compilation_cache_dir)
    cache_dir = config.compilation.cache_dir or None
    if checkpoint is None:
        ckpt = load_checkpoint(config.model.model, cache_dir=cache_dir, native_quantization=config.model.quantization)
        for phase, seconds in ckpt.load_seconds.items():
            clock.add(phase, seconds)
    else:
        ckpt = checkpoint              # loaded before this build: its time is not this build's
    model_config = ModelConfig.from_hf_config(ckpt.config)
    dtype = resolve_dtype(config.model.dtype)
    tp, ep = config.parallel.tensor_parallel_size, config.parallel.expert_parallel_size
    moe = bool(model_config.moe_layers)
    check_expert_sizes(model_config.num_experts if moe else 0, model_config.moe_intermediate_size, ep, tp)
    # refuses sizes that do not divide; a caller's mesh of one device runs the mesh's program too
    layout = HeadLayout.for_model(model_config, tp) if tp > 1 or ep > 1 or mesh is not None else None
    if layout is not None and config.uses_draft_model:
        raise ValueError("speculative decoding with a draft model is not built for tensor_parallel_size > 1 "
                         "(n-gram speculation is)")
    if hosts is not None and tp * ep != jax.device_count():
        raise ValueError(f"num_hosts={host_config.num_hosts}: tensor_parallel_size={tp} (x expert_parallel_size="
                         f"{ep}) must count every host's devices ({jax.device_count()})")
    if mesh is None and layout is not None:
        # a MoE model's mesh has an "expert" axis (size 1 without expert parallelism), which its
        # expert layers split over (parallel/experts.py)
        mesh = make_moe_mesh(ep, tp) if moe else make_mesh(tp)
    elif mesh is not None and moe:
        mesh = as_moe_mesh(mesh)
    with clock.phase("params"):
        params, quant = checkpoint_params(config, ckpt, model_config, dtype, layout, mesh, cache_dir)
        ckpt = quant.checkpoint
        if config.lora.enable_lora:   # empty slots beside every projection: the steps compile with them
            params = lora_engine.slotted_params(params, model_config, config.lora.max_loras, config.lora.max_lora_rank,
                                                layout, mesh)
    source_config = model_config
    if layout is not None:   # the runner's model has the replicated KV heads (parallel/layout.py)
        model_config = dataclasses.replace(model_config, num_key_value_heads=layout.kv_heads)

    eos = set(model_config.eos_token_ids)
    if ckpt.tokenizer is not None and ckpt.tokenizer.eos_token_id is not None:
        eos.add(ckpt.tokenizer.eos_token_id)
    # the checkpoint's config (adapters name its unreplicated heads) and the stored layout
    lora = (functools.partial(lora_engine.build, model_config=source_config, max_loras=config.lora.max_loras,
                              max_rank=config.lora.max_lora_rank, heads=layout, mesh=mesh)
            if config.lora.enable_lora else None)
    # a weight update of a quantized engine goes through the same pass (engine/weight_update.py)
    requantize = (functools.partial(_requantized_params, config, dict(ckpt.config), source_config, dtype, layout, mesh)
                  if config.model.quantization != "none" else None)
    engine = _serve(config, model_config, params, dtype=dtype, kv_dtype=quant.kv_dtype, mesh=mesh, hosts=hosts,
                    clock=clock, identity=ckpt.identity, tokenizer=ckpt.tokenizer, eos_token_ids=eos,
                    model_name=os.path.basename(ckpt.source.rstrip("/")), cache_dir=cache_dir, progress=progress,
                    lora=lora, requantize=requantize,
                    chat_template=default_chat_template(ckpt.source, config.model.chat_template))
    return _with_connector(engine, config)


def _with_connector(engine: Engine, config: EngineConfig) -> Engine:
    """A prefill or decode engine gets its KV connector from the config's role settings
    (jaxserve/disagg/attach.py), here rather than in the server, so LLM(role=...) and `jaxserve
    serve --role ...` build the same engine. Imported only then: a colocated engine loads no grpc."""
    if config.disagg.role != "both":
        from jaxserve.disagg.attach import attach_connector

        attach_connector(engine, config)
    return engine


def checkpoint_params(config: EngineConfig, ckpt, model_config: ModelConfig, dtype, layout, mesh, cache_dir):
    """The params of `ckpt` as the engine serves them, and what quantization prepared: weights
    quantized (with the calibration pass fp8 and a quantized KV cache need: jaxserve/quant) and
    placed on one device, or laid out shard-major and split over the mesh's devices."""
    quant = prepare_quantization(ckpt, quant_request(config), model_config, jnp.dtype(dtype), cache_dir)
    tensors_in = quant.checkpoint.tensors
    if layout is not None and any(getattr(t, "act_smooth", None) is not None for t in tensors_in.values()):
        raise ValueError("w8a8 weights are not built for tensor_parallel_size > 1 (int8, int4 and fp8 are)")
    if layout is None:
        params = jax.block_until_ready(params_from_hf(model_config, tensors_in, jnp.dtype(dtype)))
        if quant.kv_scales is not None:
            params["kv_scales"] = {k: jnp.asarray(v) for k, v in quant.kv_scales.items()}
        return params, quant
    # tensor parallel: the host arrays are laid out shard-major and each device gets its slice
    host = params_from_hf(model_config, tensors_in, jnp.dtype(dtype), on_host=True)
    if quant.kv_scales is not None:
        host["kv_scales"] = dict(quant.kv_scales)
    tensors = layout_of(model_config)
    return jax.block_until_ready(place_params(to_shard_major(host, layout, tensors), mesh, tensors,
                                              model_config.vocab_size)), quant


def _requantized_params(config: EngineConfig, hf_config: dict, model_config: ModelConfig, dtype, layout, mesh,
                        tensors: dict) -> dict:
    """A complete set of checkpoint-named float tensors -> the quantized engine's params, through
    the pass that built them at start (calibrated modes calibrate again, on the new weights)."""
    # a fresh identity: the calibration must never be one measured on other weights
    ckpt = Checkpoint(config=hf_config, tensors=tensors, tokenizer=None, identity="sha256:" + uuid.uuid4().hex * 2,
                      source="update_weights", format="hf")
    params, _ = checkpoint_params(config, ckpt, model_config, dtype, layout, mesh, cache_dir=None)
    return params


def build_custom_engine(config: EngineConfig, model: CustomModel, params, tokenizer, *,
                        progress: bool = True, mesh: Mesh | None = None) -> Engine:
    """An Engine on a model defined outside jaxserve (models/custom.py): no checkpoint is read
    and nothing is quantized; the params are used as given (placed on the mesh by the model's
    partition_specs when tensor_parallel_size > 1) and the rest is build_engine's: arena,
    runner, warm-up, calibration, scheduler. Refuses what is not built for custom models."""
    if not isinstance(model, CustomModel):
        raise TypeError(f"model must be a CustomModel, got {type(model).__name__}")
    if tokenizer is None:
        raise ValueError(f"LLM(model=CustomModel(...)) needs tokenizer=<a transformers tokenizer for "
                         f"{model.name}>: the engine reads prompts and writes text with it")
    refused = []
    if config.model.quantization != "none":
        refused.append(f"quantization={config.model.quantization!r} (custom models are served as their params are: "
                       f"quantize them in your own forward)")
    if config.cache.kv_cache_dtype != "auto":
        refused.append(f"kv_cache_dtype={config.cache.kv_cache_dtype!r} (custom models keep K/V in the arena dtype, "
                       f"`dtype`)")
    if config.parallel.num_hosts != 1:
        refused.append(f"num_hosts={config.parallel.num_hosts} (custom models run on one host)")
    if config.parallel.expert_parallel_size != 1:
        refused.append(f"expert_parallel_size={config.parallel.expert_parallel_size} (a custom model's experts, "
                       f"if any, are placed by its own partition_specs)")
    if config.disagg.role != "both":
        refused.append(f"role={config.disagg.role!r} (disaggregated prefill/decode is not built for custom models)")
    if config.uses_draft_model:
        refused.append("speculative decoding with a draft model (n-gram speculation works)")
    if config.lora.enable_lora:
        refused.append("enable_lora (LoRA slots sit beside the registry architectures' projections)")
    if refused:
        raise ValueError(f"not supported for a custom model ({model.name}): " + "; ".join(refused))
    vocab = len(tokenizer)
    if vocab > model.vocab_size:
        raise ValueError(f"the tokenizer has {vocab} tokens, more than {model.name}'s vocab_size={model.vocab_size}")
    clock = PhaseClock()
    enable_compilation_cache(config.compilation.compilation_cache_dir)
    tp = config.parallel.tensor_parallel_size
    _check_caller_mesh(mesh, config)
    if mesh is None:
        mesh = make_mesh(tp) if tp > 1 else None
    with clock.phase("params"):
        params = custom.check_params(model, params)
        model_config = custom.model_config(model, hidden_size=custom.check_model(model, params))
        identity = custom.model_identity(model, params)
        if mesh is not None:
            params = custom.tensor_parallel_params(model, params, mesh, tp)
        params = jax.block_until_ready(custom.runner_params(params))
    # the params are used as given, never cast: the arena holds K/V in their floating dtype
    dtype = custom.floating_dtype(params) or resolve_dtype("auto")
    if config.model.dtype not in ("auto", dtype):
        raise ValueError(f"dtype={config.model.dtype!r}: {model.name}'s params are {dtype}, and a custom model runs in "
                         f"its params' dtype (cast them before handing them over; dtype='auto' takes theirs)")
    eos = set(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return _serve(config, model_config, params, dtype=dtype, mesh=mesh, hosts=None, clock=clock, identity=identity,
                  tokenizer=tokenizer, eos_token_ids=eos, model_name=model.name,
                  cache_dir=config.compilation.cache_dir or None,
                  progress=progress, model=custom.CustomModelAdapter(model, identity))


def _serve(config: EngineConfig, model_config: ModelConfig, params, *, dtype: str, mesh, hosts, clock: PhaseClock,
           identity: str, tokenizer, eos_token_ids: set[int], model_name: str, cache_dir: str | None,
           progress: bool, kv_dtype: str | None = None, model=None, lora=None, requantize=None,
           chat_template: str | None = None) -> Engine:
    """From placed params on: the KV arena, the runner and its executables, warm-up, calibration,
    the draft model, the scheduler and the Engine. `dtype`: the model's (and the arena's, unless
    `kv_dtype` says otherwise); `model`: the runner's forward (None: the config's architecture in
    the registry); `lora`: (runner, scheduler) -> the engine's EngineLoRA (enable_lora);
    `requantize`: a quantized engine's pass from float tensors to its params; `chat_template`: the
    one used instead of the tokenizer's (default: config.model.chat_template)."""
    tp = config.parallel.tensor_parallel_size
    if config.compilation.warm_up in warm_start.BACKGROUND_MODES:
        refusal = warm_start.background_refusal(config, multi_host=hosts is not None)
        if refusal is not None:
            log.info("warm_up=%r is not built for %s: every bucket warms before the engine is ready",
                     config.compilation.warm_up, refusal)
            config = dataclasses.replace(config, compilation=dataclasses.replace(config.compilation, warm_up="all"))
    max_model_len = config.model.max_model_len or min(model_config.max_position_embeddings, MAX_DEFAULT_MODEL_LEN)
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                         f"{model_config.max_position_embeddings}")
    kv_memory = config.cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    arena = plan_arena(model_config, block_size=config.cache.block_size, dtype=kv_dtype or dtype,
                       num_kv_blocks=config.cache.num_kv_blocks, kv_cache_memory=kv_memory, shards=tp)
    shapes = runner_shapes(config, max_model_len)
    with clock.phase("kv_arena"):
        runner = ModelRunner(model_config, params, arena, shapes, attention_impl=config.compilation.attention_impl,
                             xla_optimization_level=config.compilation.xla_optimization_level,
                             logprobs_mode=config.rl.logprobs_mode,
                             # several hosts: no swap (its start-up measurement runs outside the steps
                             # the followers mirror); preemption recomputes
                             num_host_blocks=(0 if hosts is not None
                                              else host_pool_blocks(config, arena.bytes_per_block)),
                             executable_cache=_cache(ExecutableCache, cache_dir, "executables"), mesh=mesh,
                             coupled_with_draft=config.uses_draft_model, model=model,
                             features=step_features(config, model_config),
                             expert_dispatch=config.parallel.expert_dispatch, batch_invariant=config.rl.batch_invariant,
                             fuse_sampler=fused_sampler(config))
        jax.block_until_ready(runner.kv_caches)
    with clock.phase("executables"):
        runner.warm_helpers()
    if hosts is not None:
        if not hosts.config.is_leader:
            log.info("host rank %d of %d: running the leader's steps", hosts.config.host_rank, hosts.config.num_hosts)
            if config.compilation.warm_up == "all":
                runner.load_executables(progress=progress)   # compiled here while rank 0 compiles its own
            hosts.follow_then_exit(runner)    # until rank 0 ends (or the watchdog ends this process)
        lead(hosts, runner)                   # from here every step rank 0 runs, the followers run too
    plan = warm_start.plan(config, runner) if config.compilation.warm_up in warm_start.BACKGROUND_MODES else None
    if config.compilation.warm_up == "all" or plan is not None:
        # background: only the first set's buckets now, the rest once the engine serves
        report = warm_up(runner, plan.first if plan is not None else None, progress=progress)
        clock.add("executables", report.load_seconds)
        clock.add("warm_up", report.run_seconds)

    deferred = None
    with clock.phase("calibration"):
        if plan is None:
            calibration = _calibrate(config, runner, identity, cache_dir)
        else:
            # a server warming in the background turns ready without measuring: what the cache
            # lacks is measured once the engine is idle (DeferredCalibration), not before ready
            calibration, deferred = _calibrate_or_defer(config, runner, identity, cache_dir)
    draft = None
    if config.uses_draft_model:
        with clock.phase("draft_model"):
            draft = build_draft_runner(config, runner, cache_dir, dtype, progress=progress)
    scheduler = _scheduler(config, runner, max_model_len, calibration, draft)
    warming = warm_start.prepare(scheduler, runner, plan) if plan is not None else None
    engine = Engine(
        scheduler=scheduler, runner=runner,
        tokenizer=apply_chat_template_override(tokenizer, chat_template or config.model.chat_template),
        vocab_size=model_config.vocab_size, max_model_len=max_model_len, eos_token_ids=eos_token_ids,
        seed=config.model.seed, checkpoint_identity=identity, model_name=model_name,
        calibration=calibration, async_scheduling=config.async_scheduling, draft_runner=draft,
        startup_timings=clock.timings(), deferred_calibration=deferred, requantize=requantize,
        lora=lora(runner, scheduler, warm_writer=warming is None) if lora is not None else None,
        background_warm_up=warming,
    )
    if config.kv_events_config is not None:
        engine.attach_kv_events(kv_event_publisher(config.kv_events_config))
    pace_collector(config.python_gc_threshold)
    log.info("%s", engine.startup_timings.describe())
    if warming is not None:
        helpers = [("the grammar tokenizer", engine.input_processor.grammars.warm)]
        if engine.lora is not None:
            helpers.append(("the LoRA slot writer", functools.partial(engine.lora.device.warm, runner.params)))
        warming.start(helpers=helpers)
    return engine


def prepare_for_requests(engine: Engine, requests: Sequence[tuple[int, int]], *,
                         progress: bool = False) -> StartupTimings:
    """Load and run once every step that an engine's first requests can need, before they are
    added: for an engine built with warm_up="none" whose first requests are known (`jaxserve
    generate`). `requests`: (prompt tokens, most output tokens) per sequence. Adds the time to the
    engine's start-up timings and returns them."""
    report = warm_up(engine.runner, buckets_for_requests(engine.runner.shapes, requests), progress=progress)
    timings = engine.record_startup(executables=report.load_seconds, warm_up=report.run_seconds)
    log.info("warmed %d steps %s for %d sequences; %s", len(report.ran), report.ran, len(requests),
             timings.describe())
    return timings


def _calibrate(config: EngineConfig, runner: ModelRunner, checkpoint_identity: str, cache_dir: str | None,
               *, measure: bool = True) -> StartupCalibration:
    """The swap cost model, the chunk policy and (adaptive speculation) the decode-only step
    times, from timings measured now or kept by an earlier start under the same key
    (runner/calibration.py). measure=False: from the cache only (CalibrationMiss where it lacks one)."""
    calibrator = Calibrator(runner, cache=_cache(CalibrationCache, cache_dir, "calibration"),
                            key=CalibrationKey.for_runner(runner, checkpoint_identity), measure=measure)
    calibration = _measured(config, runner, calibrator)
    calibrator.save()
    if calibrator.measured or calibrator.reused:
        log.info("calibration: measured %s; from the cache %s", calibrator.measured or "nothing",
                 calibrator.reused or "nothing")
    return calibration


def _measured(config: EngineConfig, runner: ModelRunner, calibrator: Calibrator) -> StartupCalibration:
    return StartupCalibration(
        chunk_policy=resolve_chunk_policy(config, calibrator),
        swap_cost=calibrator.measure_swap_cost() if runner.host_pool is not None else None,
        decode_step_seconds=measure_decode_step_seconds(calibrator) if config.adaptive_speculation else ())


def _calibrate_or_defer(config: EngineConfig, runner: ModelRunner, checkpoint_identity: str,
                        cache_dir: str | None) -> tuple[StartupCalibration, DeferredCalibration | None]:
    """The cached calibration, or (where the cache lacks a timing: a cold start) the provisional
    one (no chunk cap, recompute on preemption) and the calibration to run later. Measuring
    compiles and runs the buckets it times: 85 of a cold `serve`'s 106 s before ready on our idle
    CPU (docs/benchmarks.md)."""
    try:
        return _calibrate(config, runner, checkpoint_identity, cache_dir, measure=False), None
    except CalibrationMiss as miss:
        log.info("calibration: %s is not cached; prefill chunks: %s (measured once the engine is idle "
                 "and every bucket warm)", miss, PROVISIONAL.describe())
        return StartupCalibration(PROVISIONAL), DeferredCalibration(
            functools.partial(_calibrate, config, runner, checkpoint_identity, cache_dir))


def measure_decode_step_seconds(calibrator) -> tuple[tuple[int, float], ...]:
    """Decode-only step time per compiled decode-only bucket: what speculation's extra rows cost
    (sched/speculation.py)."""
    shapes = calibrator.shapes
    return tuple((r, calibrator.measure_decode_step_time(context=DECODE_CONTEXT, rows=r))
                 for r in shapes.decode_only_buckets or shapes.decode_buckets)


def _cache(kind, cache_dir: str | None, name: str):
    return kind(os.path.join(cache_dir, name)) if cache_dir else None


def kv_event_publisher(config):
    """The publisher of a KVEventsConfig (jaxserve/kv_events/publisher.py; ZeroMQ is imported
    only by an engine that publishes)."""
    from jaxserve.kv_events.publisher import KVEventPublisher, NullPublisher

    return KVEventPublisher(config) if config.publisher == "zmq" else NullPublisher()


def host_pool_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Blocks of the engine's one host pool: swap space and the prefix cache's host tier share it
    (a swap preemption evicts host-tier blocks when it needs their room)."""
    return config.cache.host_pool_bytes() // bytes_per_block


def _scheduler(config: EngineConfig, runner: ModelRunner, max_model_len: int, calibration: StartupCalibration,
               draft: ModelRunner | None = None, *, kv_events: bool = True) -> Scheduler:
    """The scheduler of the config's options and what start-up derived for them: the KV pool of
    the runner's arena, the calibration's knobs, the runner's shapes. kv_events: its prefix cache
    records KV events when the config publishes them."""
    cache = config.cache
    arena_blocks = runner.arena_spec.num_blocks
    usable = arena_blocks if cache.usable_kv_blocks is None else min(arena_blocks, cache.usable_kv_blocks + 1)
    host_blocks = runner.host_pool.num_blocks if runner.host_pool is not None else 0
    swap_blocks = min(host_blocks, cache.swap_space // runner.arena_spec.bytes_per_block)
    draft_seconds = (measure_decode_step_seconds(Calibrator(draft))
                     if draft is not None and config.adaptive_speculation else ())
    return Scheduler(SchedulerConfig.from_options(
        config.scheduler,
        num_blocks=usable,
        block_size=cache.block_size,
        max_model_len=max_model_len,
        enable_prefix_caching=cache.enable_prefix_caching,
        chunk_granularity=config.compilation.prefill_tile,
        **calibration.scheduler_knobs(),
        # a host pool held only for the prefix cache's tier has no room to swap into
        preemption_mode=config.scheduler.preemption_mode if swap_blocks else "recompute",
        num_host_blocks=host_blocks,
        enable_kv_offload=bool(cache.kv_offload_gib) and host_blocks > 0,
        kv_events=kv_events and config.kv_events_config is not None,
        speculation=config.speculative_config,
        max_decode_rows=(runner.shapes.decode_only_buckets or runner.shapes.decode_buckets)[-1],
        decode_step_seconds=calibration.decode_step_seconds,
        draft_step_seconds=draft_seconds,
        max_loras=config.lora.slots,
    ), draft_proposer=DraftModelProposer(draft) if draft is not None else None)


def _check_caller_mesh(mesh: Mesh | None, config: EngineConfig) -> None:
    """A mesh handed to the builder is the engine's own kind (parallel/mesh.py `engine_mesh` makes
    it from a caller's), tensor_parallel_size long, on one host."""
    if mesh is None:
        return
    if tuple(mesh.axis_names) != AXES or mesh.shape[DATA_AXIS] != 1:
        raise ValueError(f"the builder takes a ({DATA_AXIS!r} 1, {MODEL_AXIS!r} N) mesh, got {dict(mesh.shape)}: "
                         f"pass a caller's mesh through jaxserve.parallel.mesh.engine_mesh (LLM(mesh=...) does)")
    if mesh.shape[MODEL_AXIS] != config.parallel.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={config.parallel.tensor_parallel_size} but the mesh's tensor-parallel "
                         f"axis has {mesh.shape[MODEL_AXIS]} devices")
    if config.parallel.num_hosts != 1:
        raise ValueError(f"num_hosts={config.parallel.num_hosts}: an engine on a caller's mesh runs on one host")
    if config.parallel.expert_parallel_size != 1:
        raise ValueError(f"expert_parallel_size={config.parallel.expert_parallel_size} is not built on a caller's mesh "
                         f"(it takes a 1-D tensor-parallel mesh; leave mesh= out to split the experts)")


def _engine_on_shared_runner(config: EngineConfig, other: Engine) -> Engine:
    """The new engine will overwrite arena blocks that `other`'s prefix cache still names, so
    that cache is emptied first (its KV would no longer be what its keys say)."""
    if other.has_unfinished_requests():
        raise ValueError("cannot share the runner of an engine that still has requests")
    if config.lora.enable_lora or getattr(other, "lora", None) is not None:
        # the slots' contents follow one engine's registry and scheduler
        raise ValueError("an engine with enable_lora=True does not share its runner (nor takes another's)")
    other.reset_prefix_cache()
    # the runner is the same, so are its measurements (kept on it): this engine's calibration
    # reads them, and measures only what the other engine's did not need
    calibration = _measured(config, other.runner, Calibrator(other.runner))
    draft = None
    if config.uses_draft_model:
        draft = other.draft_runner
        if draft is None:
            raise ValueError("a draft model is loaded with the runner: share the runner of an engine built with "
                             "the same speculative_config")
    engine = Engine(
        # the first engine publishes KV events (on the endpoint the config names), not this one
        scheduler=_scheduler(config, other.runner, other.max_model_len, calibration, draft, kv_events=False),
        runner=other.runner,
        draft_runner=draft,
        tokenizer=other.tokenizer, vocab_size=other.vocab_size, max_model_len=other.max_model_len,
        eos_token_ids=other.eos_token_ids, seed=config.model.seed, checkpoint_identity=other.checkpoint_identity,
        model_name=other.model_name, calibration=calibration, async_scheduling=config.async_scheduling,
        startup_timings=StartupTimings(),     # it loaded, compiled and measured nothing
        requantize=other.requantize,
    )
    return engine
