"""The PyTorch path at its best on a CPU (`--backend hf-compiled`: static KV cache, the decode step
torch.compile'd) gives the tokens the eager path gives, greedy on the same weights, batches padded
to one shape included; the compile happens in the warmup. Slow: inductor compiles C++ (minutes
on 2 cores)."""

import pytest

from jaxserve.bench import cli


@pytest.mark.slow
def test_hf_compiled_agrees_with_hf_token_for_token(tiny_model_dir, tmp_path):
    import json

    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    res = cli.main(["bench", "throughput", "--model", tiny_model_dir, "--output-dir", str(tmp_path), "--no-progress",
                    "--num-warmup", "1", "--backend", "hf,hf-compiled", "--num-prompts", "5", "--input-len", "8:40",
                    "--output-len", "2:6", "--hf-batch-size", "2", "--name", "hfc", "--no-plots"])
    with open(res["files"][0]) as f:
        data = json.load(f)
    eager, compiled = data["runs"]
    assert (eager["backend"], compiled["backend"]) == ("hf", "hf-compiled")
    assert compiled["config"]["cache"] == "static" and compiled["metrics"]["completed"] == 5
    assert compiled["agreement"]["reference"] == eager["label"]
    assert compiled["agreement"]["identical"] == compiled["agreement"]["compared"] == 5
    assert counters["stats"]["unique_graphs"] > graphs     # it compiled (transformers did not skip it)
    # only the requested tokens count: the copies that pad the last batch are not in the run
    assert compiled["metrics"]["total_output_tokens"] == data["workload"]["total_output_tokens"]
