"""Start-up: every phase timed and logged; a second start with the same cache directory compiles
nothing and measures nothing. Counted, never timed."""

import json
import logging
import os
import re
import subprocess
import sys

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.startup_timings import PhaseClock, StartupTimings
from jaxserve.runner import compile_counter
from tests.conftest import TINY_ENGINE

PHASES = ("weights", "tokenizer", "identity", "params", "kv_arena", "executables", "warm_up", "calibration",
          "draft_model")


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


_SECOND_START = """
import json, logging, sys
from jaxserve import LLM, SamplingParams
from jaxserve.runner import compile_counter
config = json.loads(sys.argv[2])
first = LLM(sys.argv[1], **config)
before = compile_counter.compilations()
records = []
handler = logging.Handler()
handler.emit = lambda r: records.append(r.getMessage())
logging.getLogger("jaxserve.engine.builder").addHandler(handler)
logging.getLogger("jaxserve.engine.builder").setLevel(logging.INFO)
second = LLM(sys.argv[1], **config)
prompt = [{"prompt_token_ids": list(range(3, 50))}]
params = SamplingParams(max_tokens=6, ignore_eos=True)
print(json.dumps({
    "compiled_by_second": compile_counter.compilations() - before,
    "measured_nothing": any("calibration: measured nothing" in m for m in records),
    "same_chunk_policy": second.engine.chunk_policy == first.engine.chunk_policy,
    "same_swap_cost": second.engine.calibration.swap_cost == first.engine.calibration.swap_cost,
    "same_tokens": (second.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
                    == first.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids),
}))
"""


def test_a_second_start_with_the_same_cache_compiles_and_measures_nothing(tiny_llama_dir, tmp_path):
    # a start is a new process: JAX's in-memory and persistent caches are empty there (in this
    # process earlier tests compiled the same programs, and what JAX hands back from its caches
    # is never kept: executables.compile_to_keep)
    config = {**TINY_ENGINE, "cache_dir": str(tmp_path), "long_prefill_token_threshold": None}
    run = subprocess.run([sys.executable, "-c", _SECOND_START, tiny_llama_dir, json.dumps(config)],
                         capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"compiled_by_second": 0, "measured_nothing": True, "same_chunk_policy": True,
                      "same_swap_cost": True, "same_tokens": True}


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
