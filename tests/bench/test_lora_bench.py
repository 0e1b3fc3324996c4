"""`jaxserve bench lora` end to end on the session's tiny Llama: three engines' throughput side by
side (no LoRA, LoRA without adapters, LoRA mixing adapters), the ratios, adapter load times, and
nothing compiled after warm-up on either engine."""

import json

import pytest

from jaxserve.bench import cli


@pytest.mark.slow     # two engines compiled with the bench's own settings (~1 min on 2 cores)
def test_bench_lora_reports_three_throughputs_ratios_and_load_times(tiny_llama_dir, tmp_path):
    result = cli.main(["bench", "lora", "--model", tiny_llama_dir, "--output-dir", str(tmp_path), "--name", "t",
                       "--adapters", "2", "--max-loras", "2", "--rank", "4", "--max-lora-rank", "8", "--prompts", "4",
                       "--prompt-len", "8", "--output-len", "4", "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "32", "--repeats", "2"])
    with open(tmp_path / "t.json") as f:
        saved = json.load(f)
    assert saved["ratios"] == result["ratios"]
    tput = saved["throughput"]
    for label in ("base_engine", "lora_engine_no_adapter", "lora_engine_2_adapters"):
        assert tput[label]["tok_s"] > 0 and len(tput[label]["runs_s"]) == 2
    assert tput["output_tokens"] == 16
    assert saved["load"]["register_s"] > 0 and saved["load"]["slot_write_s"] > 0
    assert saved["compilations_after_warmup"] == {"base": 0, "lora": 0}
