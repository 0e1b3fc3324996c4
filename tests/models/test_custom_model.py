"""A model defined outside jaxserve (examples/serve_your_own_model.py: plain JAX, its own params
and RoPE, a sliding layer and soft-capped scores) served through CustomModel: greedy tokens equal
to the same model run without the engine (its own dense causal attention, the whole sequence
recomputed for every token) with the prefix cache hit, a prompt chunked over several steps,
preemption, n-gram speculation and the one-step-ahead loop; nothing compiled after warm-up; no
leaked block; clear errors for what is missing or refused; an identity that follows the model's
source; a Flax NNX model; tensor parallelism on 2 CPU devices (a child process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples import serve_your_own_model as ex
from jaxserve import CustomModel, LLM, SamplingParams
from jaxserve.models import custom
from jaxserve.models.config import FULL_ATTENTION, SLIDING_ATTENTION
from jaxserve.testing.tiny_models import make_tokenizer
from tests.conftest import TINY_ENGINE
from tests.sched.sched_testkit import check_invariants

NEW_TOKENS = 36
# adaptive=False: every guess the lookup finds is verified (tests/engine/test_speculative.py)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

_rng = np.random.default_rng(7)
SHARED = _rng.integers(3, ex.VOCAB, 40).tolist()                  # 10 full blocks of 4 tokens
FIRST = SHARED + _rng.integers(3, ex.VOCAB, 6).tolist()            # run alone first: its blocks get cached
WITH_SHARED = [SHARED + _rng.integers(3, ex.VOCAB, n).tolist() for n in (3, 9)]
LONG = _rng.integers(3, ex.VOCAB, 70).tolist()                     # > max_num_batched_tokens=32: 3 steps
# repeats itself, so n-gram lookup finds guesses
REPEATING = ([11, 12, 13, 14, 15] * 5)[:23]
TEXT = "The tide comes in twice a day"
BATCH = WITH_SHARED + [LONG, REPEATING]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(ex.VOCAB)


@pytest.fixture(scope="module")
def params():
    return ex.init_params(seed=0)


@pytest.fixture(scope="module")
def llm(tokenizer, params):
    return LLM(model=ex.custom_model(tokenizer.eos_token_id), params=params, tokenizer=tokenizer, **TINY_ENGINE)


@pytest.fixture(scope="module")
def reference(params):
    """prompt ids -> the greedy continuation without the engine (each choice checked to be no tie)."""
    cache = {}

    def of(prompt_ids):
        key = tuple(prompt_ids)
        if key not in cache:
            tokens, gap = ex.reference_generate(params, list(prompt_ids), NEW_TOKENS, pad_to=128)
            assert gap > 1e-3, f"a near-tie ({gap}) would make the comparison luck"
            cache[key] = tokens
        return cache[key]

    return of


def ids_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def check_outputs(outputs, prompts, reference):
    for out, prompt in zip(outputs, prompts):
        assert out.prompt_token_ids == list(prompt)
        assert list(out.outputs[0].token_ids) == reference(prompt), f"prompt of {len(prompt)} tokens"


def test_greedy_tokens_equal_full_recomputation_with_prefix_hits_and_chunking(llm, reference, tokenizer):
    assert len(LONG) > TINY_ENGINE["max_num_batched_tokens"] and len(LONG) > ex.SLIDING_WINDOW
    check_outputs(llm.generate(ids_prompts([FIRST]), GREEDY, use_tqdm=False), [FIRST], reference)
    before = llm.stats().scheduler.prefix_cache_hits
    outs = llm.generate(ids_prompts(BATCH) + [TEXT], GREEDY, use_tqdm=False)
    check_outputs(outs[:-1], BATCH, reference)
    # a text prompt goes through the tokenizer handed over; its text comes back decoded by it
    text = outs[-1]
    assert text.prompt_token_ids == tokenizer(TEXT)["input_ids"]
    assert list(text.outputs[0].token_ids) == reference(text.prompt_token_ids)
    # (the incremental detokenizer holds back a trailing incomplete UTF-8 character)
    assert text.outputs[0].text and tokenizer.decode(text.outputs[0].token_ids, skip_special_tokens=True).startswith(
        text.outputs[0].text)
    stats = llm.stats()
    assert stats.scheduler.prefix_cache_hits - before >= 2 * (len(SHARED) // TINY_ENGINE["block_size"])
    assert stats.steps.num_compilations_after_warmup == 0
    check_invariants(llm.engine.scheduler)
    assert stats.scheduler.num_running == 0


@pytest.mark.parametrize("overrides", [
    # two of the four no longer fit beside each other
    dict(usable_kv_blocks=30, preemption_mode="recompute"),
    dict(usable_kv_blocks=30, preemption_mode="swap"),
    dict(speculative_config=NGRAM),
    dict(async_scheduling=False),              # the loop that waits for each step's tokens
], ids=["preemption-recompute", "preemption-swap", "ngram-speculation", "no-one-step-ahead"])
def test_outputs_are_unchanged_under(llm, reference, overrides):
    other = LLM.sharing_runner(llm, **overrides)
    check_outputs(other.generate(ids_prompts(BATCH), GREEDY, use_tqdm=False), BATCH, reference)
    stats = other.stats()
    if overrides.get("preemption_mode") == "recompute":
        assert stats.scheduler.num_preemptions_recompute > 0
    if overrides.get("preemption_mode") == "swap":
        assert stats.scheduler.num_preemptions_swap > 0
    if "speculative_config" in overrides:
        assert stats.scheduler.spec_num_verifications > 0 and stats.scheduler.spec_num_draft_tokens > 0
    assert stats.steps.num_compilations_after_warmup == 0
    check_invariants(other.engine.scheduler)


def test_the_model_identity_keys_the_executables_and_names_the_engine(llm, params):
    identity = llm.checkpoint_identity
    assert identity == custom.model_identity(llm.custom_model, params)
    assert llm.engine.runner.programs.identity["model_identity"] == identity
    assert llm.engine.model_name == "tiny-rope-lm"
    # other shapes (a longer vocabulary row), other identity
    wider = {**params, "unembed": jnp.zeros((ex.D_MODEL, ex.VOCAB + 1))}
    assert custom.model_identity(llm.custom_model, wider) != identity
    assert custom.model_identity(dataclasses.replace(llm.custom_model, version="weights-v2"), params) != identity


def test_editing_the_model_source_changes_its_identity(tmp_path, monkeypatch):
    module = tmp_path / "my_lab_model.py"
    module.write_text(textwrap.dedent("""
        def forward(params, input_ids, positions, kv_caches, attention):
            return params["e"][input_ids], kv_caches

        def compute_logits(params, hidden):
            return hidden
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    mod = importlib.import_module("my_lab_model")
    model = CustomModel(forward=mod.forward, compute_logits=mod.compute_logits, num_layers=1, num_heads=1,
                        num_kv_heads=1, head_dim=4, vocab_size=4, max_position_embeddings=16)
    params = {"e": jnp.zeros((4, 4))}
    before = custom.model_identity(model, params)
    assert custom.model_identity(model, params) == before                      # stable
    module.write_text(module.read_text() + "\nSCALE = 2.0   # an edit the forward may read\n")
    assert custom.model_identity(model, params) != before


def test_the_attention_description_maps_onto_the_engine_config():
    m = ex.custom_model()
    config = custom.model_config(m, hidden_size=ex.D_MODEL)
    assert config.model_type == "custom"
    assert config.layer_types == (FULL_ATTENTION, SLIDING_ATTENTION)
    for i in range(ex.NUM_LAYERS):
        spec = config.layer_attention(i)
        assert spec == m.layer_attention(i)
        assert spec.sliding_window == (ex.SLIDING_WINDOW if i in ex.SLIDING_LAYERS else None)
        assert spec.soft_cap == ex.SOFT_CAP and spec.sm_scale == ex.HEAD_DIM ** -0.5
    scaled = custom.model_config(dataclasses.replace(m, attention_scale=0.1, sliding_window=None,
                                                     sliding_layers=None, attn_soft_cap=None), hidden_size=64)
    assert scaled.layer_types is None
    assert [scaled.layer_attention(i).sliding_window for i in range(ex.NUM_LAYERS)] == [None, None]
    assert np.isclose(scaled.layer_attention(1).sm_scale, 0.1, rtol=1e-12)
    # sliding_window alone: every layer slides
    every = custom.model_config(dataclasses.replace(m, sliding_layers=None), hidden_size=64)
    assert [every.layer_attention(i).sliding_window for i in range(ex.NUM_LAYERS)] == [ex.SLIDING_WINDOW] * 2


# -- what is missing or refused: errors before anything compiles --------------------------------

def test_missing_tokenizer_or_params_are_clear_errors(tokenizer, params):
    model = ex.custom_model()
    with pytest.raises(ValueError, match="needs tokenizer="):
        LLM(model=model, params=params, **TINY_ENGINE)
    with pytest.raises(ValueError, match="needs params="):
        LLM(model=model, tokenizer=tokenizer, **TINY_ENGINE)
    with pytest.raises(TypeError, match="pytree of jax.Arrays"):
        LLM(model=model, params={"embed": "not an array"}, tokenizer=tokenizer, **TINY_ENGINE)
    with pytest.raises(ValueError, match="params= and tokenizer= are for a model defined outside"):
        LLM("some/checkpoint", params=params, **TINY_ENGINE)


def test_a_dtype_other_than_the_params_is_refused(tokenizer, params):
    with pytest.raises(ValueError, match="dtype='bfloat16': tiny-rope-lm's params are float32"):
        LLM(model=ex.custom_model(), params=params, tokenizer=tokenizer, **{**TINY_ENGINE, "dtype": "bfloat16"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(quantization="int8"), "quantization='int8'"),
    (dict(kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype='fp8_e4m3'"),
    (dict(speculative_config={"method": "draft_model", "model": "elsewhere"}), "draft model"),
])
def test_what_custom_models_do_not_support_is_refused(tokenizer, params, kwargs, match):
    with pytest.raises(ValueError, match=f"not supported for a custom model.*{match}"):
        LLM(model=ex.custom_model(), params=params, tokenizer=tokenizer, **{**TINY_ENGINE, **kwargs})


def test_a_forward_that_breaks_the_protocol_fails_before_compiling(tokenizer, params):
    wrong_heads = dataclasses.replace(ex.custom_model(), num_heads=8)      # the forward makes 4
    with pytest.raises(ValueError, match=r"layer 0's attention got q of shape \(8, 4, 16\).*\[8, 8, 16\]"):
        LLM(model=wrong_heads, params=params, tokenizer=tokenizer, **TINY_ENGINE)

    def scanned(params_, input_ids, positions, kv_caches, attention):      # layers under lax.scan
        x = params_["embed"][input_ids]
        q = jnp.zeros((x.shape[0], ex.NUM_HEADS, ex.HEAD_DIM))
        k = jnp.zeros((x.shape[0], ex.NUM_KV_HEADS, ex.HEAD_DIM))
        jax.lax.fori_loop(0, 2, lambda i, c: c + attention(i, q, k, k, None)[0].sum(), 0.0)
        return x, kv_caches

    with pytest.raises(TypeError, match="layer index must be a Python int"):
        LLM(model=dataclasses.replace(ex.custom_model(), forward=scanned), params=params, tokenizer=tokenizer,
            **TINY_ENGINE)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        LLM(model=dataclasses.replace(ex.custom_model(), max_position_embeddings=64), params=params,
            tokenizer=tokenizer, **TINY_ENGINE)


def test_the_model_description_is_checked():
    m = ex.custom_model()
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        dataclasses.replace(m, num_kv_heads=3)
    with pytest.raises(ValueError, match="sliding_layers is set but sliding_window is not"):
        dataclasses.replace(m, sliding_window=None)
    with pytest.raises(ValueError, match=r"sliding_layers \[5\]"):
        dataclasses.replace(m, sliding_layers=(5,))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dataclasses.replace(m, eos_token_ids=(ex.VOCAB,))


# -- a Flax NNX model -------------------------------------------------------------------------

def test_a_flax_nnx_model_is_served_through_split_and_merge(tokenizer):
    from flax import nnx

    heads, kv_heads, head_dim, d, layers = 2, 1, 8, 32, 2

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.qkv = nnx.Linear(d, (heads + 2 * kv_heads) * head_dim, use_bias=False, rngs=rngs)
            self.out = nnx.Linear(heads * head_dim, d, use_bias=False, rngs=rngs)
            self.mlp = nnx.Linear(d, d, rngs=rngs)

    class TinyNNX(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(ex.VOCAB, d, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
            self.head = nnx.Linear(d, ex.VOCAB, use_bias=False, rngs=rngs)

        def __call__(self, input_ids, positions, kv_caches, attention):
            t = input_ids.shape[0]
            x, caches = self.embed(input_ids), []
            for i, block in enumerate(self.blocks):
                q, k, v = jnp.split(block.qkv(x).reshape(t, heads + 2 * kv_heads, head_dim),
                                    [heads, heads + kv_heads], axis=1)
                q, k = rope(q, positions), rope(k, positions)
                out, cache = attention(i, q, k, v, kv_caches[i])
                caches.append(cache)
                x = x + block.out(out.reshape(t, heads * head_dim))
                x = x + jax.nn.gelu(block.mlp(x))
            return x, caches

    def rope(x, positions):                # HF-style rotate-half, base 1000
        half = head_dim // 2
        angles = positions[:, None, None] * 1000.0 ** (-jnp.arange(half) / half)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        return jnp.concatenate([x[..., :half] * cos - x[..., half:] * sin,
                                x[..., half:] * cos + x[..., :half] * sin], axis=-1)

    graphdef, state = nnx.split(TinyNNX(nnx.Rngs(3)))

    def forward(state_, input_ids, positions, kv_caches, attention):
        return nnx.merge(graphdef, state_)(input_ids, positions, kv_caches, attention)

    def compute_logits(state_, hidden):
        return nnx.merge(graphdef, state_).head(hidden)

    def dense(i, q, k, v, cache):
        t = q.shape[0]
        k, v = jnp.repeat(k, heads // kv_heads, axis=1), jnp.repeat(v, heads // kv_heads, axis=1)
        scores = jnp.einsum("qnh,knh->nqk", q, k) * head_dim ** -0.5
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
        return jnp.einsum("nqk,knh->qnh", jax.nn.softmax(scores, axis=-1), v), cache

    model = CustomModel(forward=forward, compute_logits=compute_logits, num_layers=layers, num_heads=heads,
                        num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=ex.VOCAB, max_position_embeddings=64,
                        name="tiny-nnx")
    # warm_up="none": only the steps these two requests need compile (the first test counts the rest)
    small = dict(TINY_ENGINE, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, num_kv_blocks=40,
                 warm_up="none")
    llm = LLM(model=model, params=state, tokenizer=tokenizer, **small)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(40, 60))]
    outs = llm.generate(ids_prompts(prompts), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    full = jax.jit(lambda s, ids: compute_logits(s, forward(s, ids, jnp.arange(ids.shape[0]), [None] * layers,
                                                            dense)[0]))
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(np.argmax(np.asarray(full(state, jnp.asarray(ids + [0] * (64 - len(ids)))))[len(ids) - 1])))
        assert list(out.outputs[0].token_ids) == ids[len(prompt):]
    check_invariants(llm.engine.scheduler)


# -- tensor parallelism on 2 fake CPU devices (a child process: the device count is fixed at start) --

TP_CHILD = """
import json, sys
import jax
from examples import serve_your_own_model as ex
from jaxserve import LLM, SamplingParams
from jaxserve.testing.tiny_models import make_tokenizer
from tests.conftest import TINY_ENGINE
from tests.sched.sched_testkit import check_invariants

prompts = json.loads(sys.argv[1])
tok = make_tokenizer(ex.VOCAB)
params = ex.init_params(seed=0)
report = {"devices": jax.device_count()}
engine = dict(TINY_ENGINE, max_num_seqs=2, max_num_batched_tokens=16)    # fewer steps to compile
no_specs = __import__("dataclasses").replace(ex.custom_model(), partition_specs=None)
try:
    LLM(model=no_specs, params=params, tokenizer=tok, tensor_parallel_size=2, **engine)
except ValueError as e:
    report["no_specs_error"] = str(e)
llm = LLM(model=ex.custom_model(), params=params, tokenizer=tok, tensor_parallel_size=2, **engine)
wq = llm.engine.runner.params["custom"]["layers"][0]["wq"]
report["wq_shard_shape"] = list(wq.addressable_shards[0].data.shape)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=%d, temperature=0.0, ignore_eos=True), use_tqdm=False)
report["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
report["compilations"] = llm.stats().steps.num_compilations_after_warmup
report["mesh"] = [list(x) for x in llm.stats().mesh.axis_sizes]
check_invariants(llm.engine.scheduler)
print(json.dumps(report))
""" % NEW_TOKENS


@pytest.mark.slow     # a child process with 2 devices, about 20 s; the one-device path is the rest of the file
def test_tensor_parallel_on_two_devices_matches_the_reference(reference):
    from tests.parallel.cpu_devices import REPO, cpu_device_env

    prompts = [WITH_SHARED[0], LONG]
    proc = subprocess.run([sys.executable, "-c", TP_CHILD, json.dumps(prompts)], env=cpu_device_env(2), cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == 2
    assert "partition_specs" in report["no_specs_error"]
    assert report["wq_shard_shape"] == [ex.D_MODEL, ex.NUM_HEADS * ex.HEAD_DIM // 2]   # split by columns
    assert report["mesh"] == [["data", 1], ["model", 2]]
    assert report["compilations"] == 0
    for prompt, tokens in zip(prompts, report["tokens"]):
        assert tokens == reference(prompt)


# -- the executable cache: a second start loads, an edit of the model's source compiles again ---

def test_a_restart_reuses_the_compiled_steps_until_the_model_source_changes(tmp_path, monkeypatch, tokenizer, params):
    import importlib
    import random
    import shutil

    from jaxserve.runner import programs

    shutil.copy(ex.__file__, tmp_path / "lab_model_under_edit.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    lab = importlib.import_module("lab_model_under_edit")
    # warm_up="none": each start loads (or compiles) only the steps its one request needs. The
    # arena's size is drawn per run so that the steps' programs are new to XLA's persistent cache,
    # which is process-wide (the first engine's cache_dir) and may hold an earlier test's same
    # program: the first start must compile, and keep, its steps
    blocks = 40 + random.SystemRandom().randrange(4000)
    small = dict(TINY_ENGINE, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=8, num_kv_blocks=blocks,
                 cache_dir=str(tmp_path / "cache"), warm_up="none")
    kept = tmp_path / "cache" / "executables"
    prompt = {"prompt_token_ids": list(range(20, 31))}
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    # steps and samplers XLA compiled because the executable cache had none (compile_to_keep runs
    # only then, and says whether the result may be kept): counted per call, not process-wide, so
    # a compile elsewhere in the process (an earlier test's engine thread) never counts here. One
    # that XLA's persistent cache answered is not counted: it is never kept (compile_to_keep), so
    # every start takes it from there again (the samplers' programs do not depend on the arena, and
    # an earlier test may have compiled the same ones)
    compiled_steps = []
    keep = programs.compile_to_keep

    def counting(*a, **k):
        compiled, keepable = keep(*a, **k)
        if keepable:
            compiled_steps.append(1)
        return compiled, keepable

    monkeypatch.setattr(programs, "compile_to_keep", counting)

    def start():
        before = len(compiled_steps)
        llm = LLM(model=lab.custom_model(), params=params, tokenizer=tokenizer, **small)
        tokens = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        return llm, len(compiled_steps) - before, len(os.listdir(kept)), tokens

    first, compiled, files, tokens = start()
    assert compiled > 0 and files > 0
    again, compiled_again, files_again, tokens_again = start()
    assert (compiled_again, files_again) == (0, files), "the second start should load every step it kept"
    assert again.checkpoint_identity == first.checkpoint_identity and tokens_again == tokens
    with open(lab.__file__, "a") as f:
        f.write("\n# an edit: the forward's module is no longer the one the kept steps were traced from\n")
    edited, compiled_edited, files_edited, _ = start()
    assert edited.checkpoint_identity != first.checkpoint_identity
    assert compiled_edited > 0 and files_edited == 2 * files


def test_tensor_parallel_sizes_that_do_not_divide_the_heads_are_refused(params):
    odd = dataclasses.replace(ex.custom_model(), num_heads=3, num_kv_heads=1)
    with pytest.raises(ValueError, match="must divide tiny-rope-lm's num_heads=3 and num_kv_heads=1"):
        custom.tensor_parallel_params(odd, params, mesh=None, tensor_parallel_size=2)
