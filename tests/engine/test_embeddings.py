"""Embeddings (LLM.embed, PoolingParams) against HF transformers on a tiny random Llama: last and
mean pooling, normalized and not, a batch of prompts of different lengths, chunked prefill, beside
a generation request in the same steps, past a cached prefix, preempted midway (recompute and
swap), and nothing compiled after warm-up. The rows the runner pools are checked against
runner/batch.py's packing, and the refusals at the door."""

import numpy as np
import pytest

from jaxserve import LLM, PoolingParams, SamplingParams
from jaxserve.embedding_outputs import EmbeddingRequestOutput
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.pooled_embedding import PooledEmbedding
from tests.packing_oracle import pack_step
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.pooling import PooledChunk, pack
from jaxserve.sched.limits import RequestLimits
from jaxserve.sched.sampling import SamplingOptions
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from jaxserve.testing.tiny_models import hf_last_hidden_states

PROMPTS = [
    "The tide comes in",
    "def add(a, b):",
    # 40+ tokens: more than one step's 32-token budget, so it is chunked even at the default
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 and a long tail of words to make it chunked twice over",
]
# float32 against HF's float32 forward, relative to the vector's norm (measured: below 1e-6)
RTOL = 1e-5


def hf_embedding(path, ids, pooling, normalize):
    h = hf_last_hidden_states(path, ids)
    v = h[-1] if pooling == "last" else h.mean(axis=0)
    return v / np.linalg.norm(v) if normalize else v


def assert_matches_hf(path, out, pooling, normalize):
    assert isinstance(out, EmbeddingRequestOutput) and out.finished
    got = np.asarray(out.outputs.embedding)
    want = hf_embedding(path, out.prompt_token_ids, pooling, normalize)
    assert got.shape == want.shape
    assert np.linalg.norm(got - want) <= RTOL * np.linalg.norm(want), (pooling, normalize)
    if normalize:
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-6)


def test_hf_last_hidden_state_is_after_the_final_norm(tiny_llama_dir):
    import torch

    from jaxserve.testing.tiny_models import _hf_model

    ids = [5, 17, 42, 7]
    model = _hf_model(tiny_llama_dir)
    with torch.no_grad():
        normed = model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
        before = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-2][0].double().numpy()
    np.testing.assert_array_equal(hf_last_hidden_states(tiny_llama_dir, ids), normed)
    assert not np.allclose(normed, before)     # the last layer and the norm did something


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_of_a_batch_match_hf(embedding_llm, tiny_llama_dir, pooling, normalize):
    outs = embedding_llm.embed(PROMPTS, pooling=pooling, normalize=normalize, use_tqdm=False)
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert len(set(lengths)) == 3 and max(lengths) > 32     # different lengths, one chunked
    for out in outs:
        assert len(out.outputs.embedding) == embedding_llm.engine.runner.model_config.hidden_size
        assert_matches_hf(tiny_llama_dir, out, pooling, normalize)
    assert embedding_llm.stats().steps.num_compilations_after_warmup == 0


def test_chunked_prefill_gives_the_same_embeddings(embedding_llm, tiny_llama_dir):
    chunky = LLM.sharing_runner(embedding_llm, long_prefill_token_threshold=5)
    per_prompt = [PoolingParams("mean", normalize=False), PoolingParams("last"), PoolingParams("mean")]
    outs = chunky.embed(PROMPTS[2:] * 3, pooling_params=per_prompt, use_tqdm=False)
    assert len(outs[0].prompt_token_ids) > 3 * 5              # really several chunks
    for out, p in zip(outs, per_prompt):
        assert_matches_hf(tiny_llama_dir, out, p.pooling, p.normalize)
    # a one-token prompt: its only row is a decode row of the step
    one = chunky.embed({"prompt_token_ids": [11]}, pooling="mean", use_tqdm=False)[0]
    assert_matches_hf(tiny_llama_dir, one, "mean", True)
    assert chunky.stats().steps.num_compilations_after_warmup == 0


def test_embeddings_run_in_the_same_steps_as_a_generation(embedding_llm, tiny_llama_dir):
    gen = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = embedding_llm.generate(PROMPTS[1], gen, use_tqdm=False)[0].outputs[0].token_ids
    engine = LLM.sharing_runner(embedding_llm, long_prefill_token_threshold=8).engine
    steps = []
    schedule = engine.scheduler.schedule

    def recording(*a, **kw):
        out = schedule(*a, **kw)
        steps.append({r.request_id for r in out.requests})
        return out

    engine.scheduler.schedule = recording
    engine.add_request("gen", PROMPTS[1], gen)
    for _ in range(3):
        engine.step()                                 # the generation is decoding now
    engine.add_request("last", PROMPTS[2], PoolingParams("last"))
    engine.add_request("mean", PROMPTS[2], PoolingParams("mean", normalize=False))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ["gen", "last", "mean"]
    assert any({"gen", "mean"} <= s for s in steps)   # a step carried both, the embedding chunked
    assert sum("mean" in s for s in steps) > 1
    assert done["gen"].outputs[0].token_ids == alone  # the embeddings changed no token
    assert_matches_hf(tiny_llama_dir, done["last"], "last", True)
    assert_matches_hf(tiny_llama_dir, done["mean"], "mean", False)
    assert engine.stats().requests.generation_tokens_total == 12   # an embedding's one token is not counted
    assert engine.stats().steps.num_compilations_after_warmup == 0


def test_an_embedding_does_not_read_the_prefix_cache(embedding_llm, tiny_llama_dir):
    llm = LLM.sharing_runner(embedding_llm, enable_prefix_caching=True)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPTS[2], greedy, use_tqdm=False)
    assert llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0].num_cached_tokens > 0   # the prefix is cached
    hits = llm.stats().scheduler.prefix_cache_hits
    out = llm.embed(PROMPTS[2], pooling="mean", use_tqdm=False)[0]
    assert llm.stats().scheduler.prefix_cache_hits == hits                                       # ...but not read
    assert_matches_hf(tiny_llama_dir, out, "mean", True)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_embedding_preempted_midway_is_still_hf_s(embedding_llm, tiny_llama_dir, mode):
    # a background embedding in 8-token chunks, evicted by an urgent generation that needs the
    # blocks before its prompt is in (recompute computes it again from the start; swap brings it back)
    engine = LLM.sharing_runner(embedding_llm, usable_kv_blocks=26, enable_prefix_caching=False,
                                preemption_mode=mode, kv_watermark=0.0, long_prefill_token_threshold=8,
                                scheduling_policy="priority", max_num_partial_prefills=0).engine
    engine.add_request("background", PROMPTS[2], PoolingParams("mean", normalize=False), priority=1)
    engine.step()
    engine.add_request("urgent", PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                       priority=0)
    done, evicted = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        bg = engine.scheduler.get_request("background")
        evicted |= bg is not None and bg.status.is_waiting and bg.num_preemptions > 0
    assert evicted and sorted(done) == ["background", "urgent"]
    assert_matches_hf(tiny_llama_dir, done["background"], "mean", False)
    assert engine.stats().steps.num_compilations_after_warmup == 0


def test_embeddings_are_refused_where_the_engine_does_not_pool(prompt_logprobs_llm):
    with pytest.raises(ValueError, match="enable_embeddings"):
        prompt_logprobs_llm.embed("hello", use_tqdm=False)
    door = InputProcessor(tokenizer=None, vocab_size=100, eos_token_ids=frozenset(), embeddings=True,
                          limits=RequestLimits(max_model_len=64, block_size=4, num_pool_blocks=64))
    with pytest.raises(ValueError, match="empty"):
        door.process({"prompt_token_ids": []}, PoolingParams())
    with pytest.raises(ValueError, match="64"):                   # no room for its one token
        door.process({"prompt_token_ids": [1] * 64}, PoolingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        door.process({"prompt_token_ids": [1, 100]}, PoolingParams())
    assert door.process({"prompt_token_ids": [1] * 63}, PoolingParams()).pooling == PoolingParams()
    with pytest.raises(ValueError, match="pooling"):
        PoolingParams(pooling="max")


def test_a_recomputed_prompt_starts_its_sums_again():
    acc = PooledEmbedding(PoolingParams("mean", normalize=False), 6)
    ones = np.ones(3, np.float32)
    acc.add(PooledChunk(0, 4, 4 * ones))
    acc.add(PooledChunk(0, 4, 4 * ones))          # preempted and recomputed from the start
    acc.add(PooledChunk(4, 2, 8 * ones))
    assert acc.embedding() == pytest.approx([2.0, 2.0, 2.0])
    with pytest.raises(RuntimeError, match="from 2"):
        PooledEmbedding(PoolingParams("mean"), 6).add(PooledChunk(2, 2, ones))


def _req(rid, tokens, computed, *, pooling=None, sample=False, drafts=0):
    blocks = tuple(range(1, 21))
    return ScheduledRequest(rid, tuple(tokens), computed, blocks, sample, 0, SamplingOptions(pooling=pooling),
                            num_draft_tokens=drafts)


def test_pooling_rows_are_the_rows_batch_packing_gives_those_positions():
    shapes = RunnerShapes(block_size=4, max_model_len=128, prefill_tile=8, decode_buckets=(4, 8),
                          prefill_buckets=(0, 1, 2, 4, 8), decode_only_buckets=(1, 4))
    prompt = list(range(100, 130))                      # 30 prompt tokens
    reqs = [
        _req("decode", [PLACEHOLDER_TOKEN], 40, sample=True),
        _req("verify", [5, 6, 7], 20, sample=True, drafts=2),
        _req("one", prompt[9:10], 9, pooling="mean"),                   # a one-token chunk: a decode row
        _req("mid", prompt[:11], 0, pooling="mean"),                    # the first chunk of a prompt
        _req("early", prompt[:11], 0, pooling="last"),                  # last pooling, not its last chunk
        _req("quiet", list(range(50, 66)), 0),                          # a prompt that does not pool
        _req("last", prompt[20:], 20, pooling="last", sample=True),     # the last chunk: its last row
    ]
    out = SchedulerOutput(tuple(reqs), sum(len(r.token_ids) for r in reqs))
    packed = pack_step(out, shapes, {"decode": 0})
    rows = pack(out, packed.bucket, shapes.prefill_tile, num_segments=8)
    got = {rid: (first, count) for rid, first, count, _ in rows.reads}
    assert got == {"one": (9, 1), "mid": (0, 11), "last": (29, 1)}
    for rid, first, count, slot in rows.reads:
        where = np.flatnonzero(rows.segments == slot)
        assert len(where) == count
        assert packed.arrays["positions"][where].tolist() == list(range(first, first + count))
        assert packed.arrays["input_ids"][where].tolist() == prompt[first:first + count]
    assert (rows.segments < 8).sum() == 13
    quiet = SchedulerOutput((reqs[5],), 16)
    assert pack(quiet, pack_step(quiet, shapes).bucket, 8, 8) is None    # the usual step: nothing to do
