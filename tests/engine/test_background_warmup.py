"""warm_up="background": an engine that serves while its buckets still warm. The warm-up thread is
held at points the test chooses (never timed); every step the engine dispatches is checked, when
it is dispatched, against the buckets ready at that moment."""

import threading
import time

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.runner import background_warmup
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.persistent_batch import PersistentBatch
from tests.conftest import TINY_ENGINE
from tests.sched.sched_testkit import check_invariants

GUARD_S = 600   # a warm-up that never gets there fails the test instead of hanging it


@pytest.fixture
def held(monkeypatch):
    """Permits for the warm-up thread: each lets it start one more bucket."""
    permits = threading.Semaphore(0)
    monkeypatch.setattr(background_warmup, "before_bucket", lambda bucket: permits.acquire())
    return permits


class _Dispatched(list):
    """(bucket, ready) per step, and `requests`: how many requests each step carried."""

    def __init__(self):
        super().__init__()
        self.requests: list[int] = []

    def clear(self):
        super().clear()
        self.requests.clear()


@pytest.fixture
def dispatched(monkeypatch):
    """(bucket it ran in, ready then) for every step the engine's runner dispatches: the bucket
    the runner packed it into (the cheapest warm one that holds it, while some are cold)."""
    seen = _Dispatched()
    packed: list[tuple[int, int]] = []
    pack, dispatch = PersistentBatch.pack, ModelRunner.dispatch

    def recording_pack(self, *args, **kwargs):
        out = pack(self, *args, **kwargs)
        packed.append(out.bucket)
        return out

    def recording(self, sched_out, *args, **kwargs):
        handle = dispatch(self, sched_out, *args, **kwargs)
        if sched_out.requests and getattr(self, "readiness_under_test", None) is not None:
            seen.append((packed[-1], self.readiness_under_test.is_ready(packed[-1])))
            seen.requests.append(len(sched_out.requests))
        return handle

    monkeypatch.setattr(PersistentBatch, "pack", recording_pack)
    monkeypatch.setattr(ModelRunner, "dispatch", recording)
    return seen


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def _prompts(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 200, int(rng.integers(2, 60))).tolist()} for _ in range(n)]


def test_a_held_warm_up_serves_on_ready_buckets_then_lifts_the_cap(tiny_llama_dir, held, dispatched):
    llm = LLM(tiny_llama_dir, **{**TINY_ENGINE, "warm_up": "background", "swap_space": 0})
    engine, runner = llm.engine, llm.engine.runner
    warming = engine.background_warm_up
    readiness = warming.readiness
    runner.readiness_under_test = readiness
    first = set(readiness.plan.first)
    assert {b for b in runner.shapes.buckets() if readiness.is_ready(b)} == first
    # at ready every seat is served (4), with a prompt tile beside their decodes: 2 tiles
    assert engine.scheduler.step_cap == readiness.cap
    assert engine.scheduler.step_cap.seats == TINY_ENGINE["max_num_seqs"]
    assert engine.scheduler.step_cap.tokens == 2 * TINY_ENGINE["prefill_tile"]

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = _prompts(seed=0, n=3)
    held_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [len(t) for t in held_out] == [6, 6, 6]
    assert dispatched and all(ready for _, ready in dispatched)
    assert {b for b, _ in dispatched} <= first
    assert readiness.num_ready == len(first)          # held: nothing else became ready meanwhile
    assert max(dispatched.requests) == 3           # side by side, not one seat at a time

    # up to the bucket that lifts the cap; four requests at once step only in what is ready
    lifts = readiness.plan.rest.index((TINY_ENGINE["max_num_seqs"], 4)) + 1
    for _ in range(lifts):
        held.release()
    _wait(lambda: readiness.num_ready == len(first) + lifts, "the buckets up to the full budget's")
    assert engine.scheduler.step_cap is None and not readiness.all_ready
    dispatched.clear()
    out = llm.generate(_prompts(seed=1, n=4), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6] * 4
    assert dispatched and all(ready for _, ready in dispatched)

    for _ in range(readiness.total):
        held.release()
    assert warming.join(GUARD_S)
    assert readiness.all_ready and engine.scheduler.step_cap is None and warming.failed == []
    assert engine.input_processor.grammars.warm_done and warming.helpers_failed == []   # the thread's helper
    assert readiness.num_ready == readiness.total == len(runner.shapes.buckets())

    # fully warm: each prompt alone now runs in one or two steps, not 8-token ones, and gets the
    # same greedy tokens (as the one-step-ahead loop's tests compare across batchings); then a
    # batch may use every bucket
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert alone == held_out
    dispatched.clear()
    out = llm.generate(_prompts(seed=2, n=8), SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    assert all(ready for _, ready in dispatched)
    assert runner.executables_loaded_on_demand() == []
    # the thread compiled the buckets it warmed (no executable cache here); the serving path nothing
    assert warming.compilations.count > 0
    assert llm.stats().steps.num_compilations_after_warmup == 0


def test_background_falls_back_to_warming_everything_where_a_cap_cannot_bound_the_steps(tiny_llama_dir):
    from jaxserve.engine_args import engine_config
    from jaxserve.engine.warm_start import background_refusal

    tiny = {k: v for k, v in TINY_ENGINE.items() if k != "progress"}
    assert background_refusal(engine_config(**tiny), multi_host=False) is None
    # the optional programs warm with their buckets: no fallback for them
    for flag in ("enable_prompt_logprobs", "enable_embeddings"):
        assert background_refusal(engine_config(**tiny, **{flag: True}), multi_host=False) is None
    spec = engine_config(**tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert "speculative" in background_refusal(spec, multi_host=False)
    assert "hosts" in background_refusal(engine_config(), multi_host=True)


def test_prompt_logprobs_and_embeddings_are_served_while_their_programs_warm(tiny_llama_dir, held, dispatched):
    """Both features on one engine warming in the background: requests that ask for them during
    the held warm-up step only in ready buckets, whose feature programs are warm too (none loads
    on demand), and match HF; then the rest warms and nothing compiles on the serving path."""
    from tests.conftest import EMBEDDING_ENGINE
    from tests.engine import test_embeddings, test_prompt_logprobs

    llm = LLM(tiny_llama_dir, **{**EMBEDDING_ENGINE, "enable_prompt_logprobs": True, "warm_up": "background"})
    engine, runner = llm.engine, llm.engine.runner
    warming = engine.background_warm_up
    assert warming is not None        # not the fallback to warm_up="all"
    readiness = warming.readiness
    runner.readiness_under_test = readiness
    first = set(readiness.plan.first)
    assert readiness.num_ready == len(first) < readiness.total

    prompt = test_prompt_logprobs.PROMPTS[2]      # 40+ tokens: many one-tile steps under the cap
    out = llm.generate([prompt], test_prompt_logprobs.asking(), use_tqdm=False)[0]
    test_prompt_logprobs.assert_matches_hf(tiny_llama_dir, out)
    for pooling in ("mean", "last"):
        emb = llm.embed([prompt], pooling, True, use_tqdm=False)[0]
        test_embeddings.assert_matches_hf(tiny_llama_dir, emb, pooling, True)
    assert dispatched and all(ready for _, ready in dispatched) and {b for b, _ in dispatched} <= first
    assert readiness.num_ready == len(first)          # held: served before anything else warmed
    assert runner.executables_loaded_on_demand() == []

    for _ in range(readiness.total):
        held.release()
    assert warming.join(GUARD_S)
    assert readiness.all_ready and warming.failed == [] and warming.helpers_failed == []
    dispatched.clear()
    outs = llm.generate(test_prompt_logprobs.PROMPTS, test_prompt_logprobs.asking(), use_tqdm=False)
    for out in outs:
        test_prompt_logprobs.assert_matches_hf(tiny_llama_dir, out)
    assert runner.executables_loaded_on_demand() == []
    assert llm.stats().steps.num_compilations_after_warmup == 0
    check_invariants(engine.scheduler)


class _RecordingLock:
    """runner.params_lock, recording which thread held it around what (no timing)."""

    def __init__(self, lock):
        self._lock = lock
        self.holders: list[str] = []

    def __enter__(self):
        self._lock.acquire()
        self.holders.append(threading.current_thread().name)
        return self

    def __exit__(self, *exc):
        self._lock.release()


def test_lora_adapters_load_while_the_buckets_warm(tiny_llama_dir, held, dispatched, tmp_path):
    """LoRA on an engine warming in the background: an adapter loads into its slot (a donating
    write) while the thread still warms, both sides take the runner's params lock, and the outputs
    equal those of the engine once warmed whole."""
    from jaxserve import LoRARequest
    from tests.lora.conftest import ADAPTERS, LORA_ENGINE
    from jaxserve.testing.lora_adapters import make_peft_adapter

    r, alpha, targets, rs = ADAPTERS["qv4"]
    path = make_peft_adapter(tiny_llama_dir, tmp_path / "qv4", r=r, alpha=alpha, target_modules=targets,
                             use_rslora=rs, seed=1)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = _prompts(seed=3, n=2)
    loras = [LoRARequest("qv4", 1, path), None]

    llm = LLM(tiny_llama_dir, **{**LORA_ENGINE, "warm_up": "background"})
    runner, warming = llm.engine.runner, llm.engine.background_warm_up
    assert warming is not None
    runner.params_lock = lock = _RecordingLock(runner.params_lock)
    runner.readiness_under_test = warming.readiness
    # the slot writer is the thread's helper, built before its first bucket (where the test holds
    # it); a write that came sooner would build it on the step thread, a compilation counted there
    _wait(lambda: llm.engine.lora.device.compiled, "the slot writer")
    during = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    assert all(ready for _, ready in dispatched)
    step_thread = lock.holders[:]               # the slot write, on the stepping thread
    assert step_thread and "jaxserve-bucket-warmup" not in step_thread
    # the rest warms with the adapter resident; a second adapter slot write after it
    for _ in range(warming.readiness.total):
        held.release()
    assert warming.join(GUARD_S) and warming.failed == [] and warming.helpers_failed == []
    assert "jaxserve-bucket-warmup" in lock.holders      # its first runs held it
    # warm whole, the same greedy tokens in whole-prompt steps (8-token ones before); the adapter
    # changes them (a zero lora_B would make the comparison unable to fail)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    base = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params, use_tqdm=False)]
    assert after == during and base[0] != during[0]
    assert llm.stats().steps.num_compilations_after_warmup == 0
    check_invariants(llm.engine.scheduler)


def test_serving_mode_is_ready_with_every_step_a_full_server_needs(tiny_llama_dir, held, dispatched):
    """warm_up="serving": the engine returns with every bucket but the padding-only ones warm and
    no cap; those warm only while it is idle."""
    llm = LLM(tiny_llama_dir, **{**TINY_ENGINE, "warm_up": "serving", "swap_space": 0})
    engine, runner = llm.engine, llm.engine.runner
    readiness = engine.background_warm_up.readiness
    runner.readiness_under_test = readiness
    assert engine.scheduler.step_cap is None
    assert {b for b in runner.shapes.buckets() if readiness.is_ready(b)} == set(readiness.plan.first)
    assert set(readiness.pending()) == readiness.plan.when_idle != set()
    out = llm.generate(_prompts(seed=4, n=4), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [5] * 4
    assert dispatched and all(ready for _, ready in dispatched) and max(dispatched.requests) == 4
    for _ in range(readiness.total):
        held.release()
    assert engine.background_warm_up.join(GUARD_S) and readiness.all_ready
    assert llm.stats().steps.num_compilations_after_warmup == 0
