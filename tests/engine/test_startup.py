"""Start-up: every phase timed and logged; a second start with the same cache directory compiles
nothing and measures nothing. Counted, never timed."""

import logging
import re

import jax
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.startup_timings import PhaseClock, StartupTimings
from jaxserve.runner import compile_counter
from tests.conftest import TINY_ENGINE

PHASES = ("weights", "tokenizer", "identity", "params", "kv_arena", "executables", "warm_up", "calibration")


def test_the_timings_name_every_phase_and_read_back_from_their_log_line():
    timings = StartupTimings(weights=0.5, tokenizer=0.25, executables=3.0, warm_up=1.5, total=6.0)
    assert StartupTimings.phase_names() == PHASES
    line = "2026-12-01 10:00:00 INFO jaxserve.engine.builder: " + timings.describe()
    assert StartupTimings.parse(line) == timings
    assert timings.other == pytest.approx(0.75)
    assert timings.plus(warm_up=0.5) == StartupTimings(weights=0.5, tokenizer=0.25, executables=3.0,
                                                       warm_up=2.0, total=6.5)
    clock = PhaseClock()
    with pytest.raises(ValueError, match="unknown start-up phase"):
        clock.add("compiling", 1.0)


def test_a_build_records_and_logs_every_phase(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.builder"):
        llm = LLM(tiny_llama_dir, **TINY_ENGINE)
    timings = llm.engine.startup_timings
    assert tuple(timings.phases()) == PHASES
    assert all(seconds >= 0 for seconds in timings.phases().values())
    # these phases did work in any build: loaded something, compiled, ran every bucket
    assert min(timings.weights, timings.params, timings.kv_arena, timings.executables, timings.warm_up) > 0
    assert sum(timings.phases().values()) <= timings.total
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(StartupTimings.PREFIX)]
    assert len(lines) == 1
    logged = StartupTimings.parse(lines[0])       # rounded to 10 ms per phase, 0.1 s in all
    assert logged.phases() == pytest.approx(timings.phases(), abs=0.006)
    assert logged.total == pytest.approx(timings.total, abs=0.06)


def test_a_second_start_with_the_same_cache_compiles_and_measures_nothing(tiny_llama_dir, tmp_path, caplog):
    config = {**TINY_ENGINE, "cache_dir": str(tmp_path), "long_prefill_token_threshold": None}
    # A start is a fresh process: JAX's caches are empty there. Here earlier tests compiled the
    # same programs, and an executable JAX hands back from memory or from XLA's persistent cache
    # is never kept (executables.compile_to_keep), so start from empty ones.
    jax.clear_caches()
    # nor may XLA's persistent cache serve it: a folder an earlier test set is process-wide
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        _second_start_compiles_nothing(tiny_llama_dir, config, caplog)
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)


def _second_start_compiles_nothing(tiny_llama_dir, config, caplog):
    first = LLM(tiny_llama_dir, **config)
    before = compile_counter.compilations()
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.builder"):
        second = LLM(tiny_llama_dir, **config)
    assert compile_counter.compilations() == before          # every executable came from the cache
    assert "calibration: measured nothing" in caplog.text
    assert second.engine.chunk_policy == first.engine.chunk_policy
    assert second.engine.runner.swap_cost == first.engine.runner.swap_cost
    prompt = [{"prompt_token_ids": list(range(3, 50))}]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert (second.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            == first.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)


def test_jaxserve_generate_loads_and_warms_only_what_its_prompt_needs(tiny_llama_dir, caplog, capsys):
    from jaxserve.cli import main

    flags = ["--model", tiny_llama_dir, "--max-num-seqs", "4", "--max-model-len", "128", "--block-size", "4",
             "--prefill-tile", "8", "--max-num-batched-tokens", "32", "--num-kv-blocks", "96",
             "--xla-optimization-level", "0", "--swap-space", "0", "--compilation-cache-dir", "", "--cache-dir", ""]
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        assert main(["generate", "hello world", "--raw", "--max-tokens", "5", "--ignore-eos", *flags]) == 0
    assert "[5 tokens, finish_reason=length]" in capsys.readouterr().out
    assert "not loaded ahead" not in caplog.text                   # no step was first met by the request
    warmed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warmed ")]
    # one sequence: its prompt's step (one seat, as many tiles as the prompt needs) and one-decode steps
    assert len(warmed) == 1 and re.match(r"warmed 2 steps \[\(1, 0\), \(1, \d\)\] for 1 sequences", warmed[0])
