"""`jaxserve bench sweep` end to end on a tiny random Llama: the result's structure and its arithmetic.

Nothing here depends on speed: the tiny model's step times are noise on a shared machine, so the
test checks what the result says about them (which steps, which ratios, which flags), not their size.
"""

import math
import statistics

import pytest

from jaxserve.bench import cli
from jaxserve.bench.results import load_result

# max_model_len=4096 exceeds the tiny model's 1,024 positions: that configuration must be skipped
# a benchmark command end to end (about a minute): run with -m slow
pytestmark = pytest.mark.slow

GRID = ["--max-model-len", "128,4096", "--max-num-seqs", "2", "--block-size", "8", "--prefill-tile", "8"]
ENGINE = ["--engine-arg", "num_kv_blocks=256", "--engine-arg", "xla_optimization_level=0",
          "--engine-arg", "compilation_cache_dir=''"]


@pytest.fixture(scope="module")
def sweep(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    result = cli.main(["bench", "sweep", "--model", tiny_model_dir, "--output-dir", str(out), "--name", "sweep",
                       "--no-progress", "--input-len", "20", "--steps", "2", "--repeats", "2", *GRID, *ENGINE])
    return result, load_result(str(out / "sweep.json"))


def test_the_result_file_is_what_the_command_returned(sweep):
    returned, written = sweep
    assert written["subcommand"] == "sweep" and written["runs"] == []
    (path,) = returned["files"]
    assert path.endswith("sweep.json") and written["extra"] == returned["extra"]
    assert written["workload"]["axes"]["max_model_len"] == [128, 4096]


def test_one_axis_at_a_time_from_the_resolved_default(sweep):
    data = sweep[1]["extra"]["sweep"]
    points = data["points"]
    # the default's max_model_len is the model's limit, as the engine resolves it
    assert data["default"] == {"max_model_len": 1024, "max_num_seqs": 32, "block_size": 16, "prefill_tile": 16}
    assert [p["label"] for p in points] == ["default", "max_model_len=128", "max_num_seqs=2", "block_size=8",
                                            "prefill_tile=8"]
    for p in points:
        differs = [a for a, v in p["settings"].items() if v != data["default"][a]]
        assert p["varied"] == differs and len(differs) == (0 if p["label"] == "default" else 1)
        s = p["settings"]
        assert p["kv_table_blocks"] == math.ceil((s["max_model_len"] + s["prefill_tile"]) / s["block_size"])


def test_a_configuration_that_cannot_be_built_is_skipped_with_its_reason(sweep):
    (skipped,) = sweep[1]["extra"]["skipped"]
    assert skipped["backend"] == "jaxserve[max_model_len=4096]" and "max_position_embeddings" in skipped["reason"]
    # and `bench report` reads the result like any other
    report = cli.main(["bench", "report", sweep[0]["files"][0]])
    assert "skipped jaxserve[max_model_len=4096]" in report


def test_step_times_ratios_and_flags_are_consistent(sweep):
    data = sweep[1]["extra"]["sweep"]
    for p in data["points"]:
        assert p["batch1"]["batch"] == p["default_batch1"]["batch"] == 1
        assert p["full_batch"]["batch"] == p["settings"]["max_num_seqs"]
        # the default beside it ran the same number of rows, or its own full batch if that is fewer
        assert p["default_full_batch"]["batch"] == min(p["settings"]["max_num_seqs"], data["default"]["max_num_seqs"])
        rounds = 1 if p["label"] == "default" else 2
        for key in ("batch1", "full_batch", "default_batch1", "default_full_batch"):
            t = p[key]
            # every round's steps pooled: at least --steps per round
            assert t["steps"] == len(t["step_ms"]) >= 2 * rounds and all(ms > 0 for ms in t["step_ms"])
            assert t["median_step_ms"] == pytest.approx(statistics.median(t["step_ms"]))
            assert t["per_token_ms"] == pytest.approx(t["median_step_ms"] / t["batch"])
            assert t["cached_prompt_tokens"] == 0       # fresh prompts every time, the default's included
        # each ratio is the median round's, each round's to the default timed beside it
        for key in ("batch1", "full_batch"):
            assert len(p[f"{key}_vs_default_rounds"]) == rounds
            assert p[f"{key}_vs_default"] == pytest.approx(statistics.median(p[f"{key}_vs_default_rounds"]))
        r1, rf = p["batch1_vs_default"], p["full_batch_vs_default"]
        assert p["flagged"] == [k for k, r in (("batch1", r1), ("full_batch", rf)) if r > data["flag_ratio"]]
        load = p["load_average_before_after"]
        assert len(load) == 2 and all(len(x) == 3 for x in load)
    default = data["points"][0]
    assert default["default_batch1"] == default["batch1"] and default["batch1_vs_default"] == 1.0
    assert data["flagged"] == [p["label"] for p in data["points"] if p["flagged"]]
    # a fresh timing of the default beside every configuration
    drift = data["default_median_step_ms"]
    assert drift["batch1"] == [p["default_batch1"]["median_step_ms"] for p in data["points"]]
    seqs = data["default"]["max_num_seqs"]
    assert drift["full_batch"] == [p["default_full_batch"]["median_step_ms"] for p in data["points"]
                                   if p["settings"]["max_num_seqs"] >= seqs]
    assert len(drift["full_batch"]) == len(data["points"]) - 1      # all but the max_num_seqs=2 point


def test_the_table_has_a_row_per_configuration(sweep):
    from jaxserve.bench.cmd_sweep import format_table

    points = sweep[1]["extra"]["sweep"]["points"]
    table = format_table(points).splitlines()
    assert len(table) == 2 + len(points)
    for line, p in zip(table[2:], points):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == p["label"] and cells[5] == str(p["kv_table_blocks"])
        assert cells[6] == f"{p['batch1']['median_step_ms']:.1f}" and cells[8] == str(p["full_batch"]["batch"])
