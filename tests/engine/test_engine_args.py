"""EngineConfig is nested by concern; users spell it flat (LLM keywords, CLI flags):
jaxserve/engine_args.py maps one onto the other, and nothing is kept twice by hand."""

import argparse
import dataclasses

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine_args import (add_engine_args, default_arg, engine_args, engine_config, engine_config_from_args,
                                  engine_kwargs, per_engine_args, replace_args)
from jaxserve.sched.scheduler_config import SchedulerConfig, SchedulerOptions


def test_flat_keywords_land_in_their_sections():
    config = engine_config(max_num_seqs=8, block_size=32, tensor_parallel_size=1, role="prefill",
                           logprobs_mode="processed", warm_up="none", ttft_slo_ms=900.0, max_loras=3, seed=5,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.scheduler.max_num_seqs == 8 and config.cache.block_size == 32
    assert config.disagg.role == "prefill" and config.rl.logprobs_mode == "processed"
    assert config.compilation.warm_up == "none" and config.chunking.ttft_slo_ms == 900.0
    assert config.lora.max_loras == 3 and config.model.seed == 5
    assert config.speculative_config.num_speculative_tokens == 2
    # what was not set keeps its section's default
    assert config.cache == dataclasses.replace(type(config.cache)(), block_size=32)
    # and back: the flat spelling of a config builds the same config
    assert engine_config(**engine_kwargs(config)) == config
    assert replace_args(config, max_num_seqs=4).scheduler.max_num_seqs == 4


def test_every_section_field_is_one_flat_argument():
    args = engine_args()
    sections = [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("section")]
    section_fields = [g.name for f in sections for g in dataclasses.fields(getattr(EngineConfig(), f.name))]
    own = [f.name for f in dataclasses.fields(EngineConfig) if not f.metadata.get("section")]
    assert sorted(args) == sorted(section_fields + own)
    assert len(section_fields) == len(set(section_fields))        # unique across sections
    assert all(arg.field.metadata.get("help") for arg in args.values())   # every flag has its help


def test_unknown_and_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_num_seq'\]"):
        engine_config(max_num_seq=8)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int, got 0"):
        engine_config(max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_offload_gib is a tier of the prefix cache"):
        engine_config(kv_offload_gib=1.0, enable_prefix_caching=False)
    # a check across sections
    with pytest.raises(ValueError, match="unset quantization"):
        engine_config(batch_invariant=True, quantization="int8")


def test_the_cli_flags_are_the_flat_arguments():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-num-seqs", "8", "--no-enable-prefix-caching", "--decode-buckets", "1,8",
                              "--role", "decode", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = engine_config_from_args(args)
    assert config == engine_config(max_num_seqs=8, enable_prefix_caching=False, decode_buckets=(1, 8),
                                   role="decode", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()
    with pytest.raises(SystemExit):           # a section's choices are the flag's
        parser.parse_args(["--scheduling-policy", "lifo"])
    assert default_arg("max_num_seqs") == EngineConfig().scheduler.max_num_seqs


def test_a_shared_runner_may_change_what_the_runner_was_not_built_from():
    free = per_engine_args()
    # the scheduler's options but the two that size the buckets, chunking, and the per-engine fields
    options = {f.name for f in dataclasses.fields(SchedulerOptions)}
    assert options - free == {"max_num_seqs", "max_num_batched_tokens"}
    assert {"chunk_policy", "ttft_slo_ms", "seed", "usable_kv_blocks", "enable_prefix_caching",
            "async_scheduling", "speculative_config"} <= free
    assert not {"block_size", "dtype", "prefill_tile", "decode_buckets", "enable_lora", "tensor_parallel_size",
                "kv_cache_dtype", "enable_prompt_logprobs", "role", "num_kv_blocks"} & free


def test_the_scheduler_config_takes_the_options_whole():
    options = SchedulerOptions(max_num_seqs=6, max_num_batched_tokens=96, scheduling_policy="priority",
                               max_waiting_requests=3, kv_watermark=0.1, preemption_mode="recompute")
    config = SchedulerConfig.from_options(options, num_blocks=40, block_size=8, max_model_len=64)
    for f in dataclasses.fields(SchedulerOptions):
        assert getattr(config, f.name) == getattr(options, f.name), f.name
    # a derived value replaces an option the runner cannot serve (no host pool to swap into)
    swap = dataclasses.replace(options, preemption_mode="swap")
    assert SchedulerConfig.from_options(swap, num_blocks=40, preemption_mode="recompute").preemption_mode == "recompute"
    with pytest.raises(ValueError, match="needs a host pool"):
        SchedulerConfig.from_options(swap, num_blocks=40)
