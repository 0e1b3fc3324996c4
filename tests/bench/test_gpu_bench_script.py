"""scripts/gpu_bench.sh and the library pieces it runs, checked without a GPU (and quickly).

The whole dry run (GPU_BENCH_SHAPE=tiny GPU_BENCH_DEVICE=cpu scripts/gpu_bench.sh) takes over a
minute, so it is not run here; these tests cover its parts: the script's syntax and its
budget/failure handling, the model shapes, the tokenizer padding, the bandwidth arithmetic and
running from a checkout without `pip install`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxserve.bench import gpu_summary, random_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "gpu_bench.sh")
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
def test_the_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


@needs_bash
@pytest.mark.parametrize("python, budget, expected", [
    ("false", "540", "gpu_bench: devices: FAILED rc=1"),   # a failing step: reported, the script goes on
    (sys.executable, "0", "gpu_bench: devices: SKIPPED"),  # no time left: steps are skipped, not started
])
def test_a_failed_or_skipped_step_is_reported_and_the_exit_status_says_so(tmp_path, python, budget, expected):
    env = {**os.environ, "GPU_BENCH_SHAPE": "tiny", "GPU_BENCH_DEVICE": "cpu", "GPU_BENCH_CACHE": str(tmp_path),
           "GPU_BENCH_BUDGET_S": budget}
    res = subprocess.run(["bash", SCRIPT, python], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert expected in res.stdout
    assert "build-model" in res.stdout and "no benchmark ran" in res.stdout
    assert "gpu_bench: FAILED steps: devices" in res.stdout
    assert str(tmp_path) in res.stdout  # results of a tiny run never go to docs/results


def test_tiny_is_the_model_the_bench_tests_always_used():
    cfg = random_model.hf_config("tiny").to_dict()
    expected = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0, rms_norm_eps=1e-6)
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0


def test_llama3_8b_has_llama_3_8b_shape():
    import torch

    config = random_model.hf_config("llama3-8b")
    cfg = config.to_dict()
    expected = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, tie_word_embeddings=False)
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rope_parameters"]["rope_theta"] == 500000.0
    assert cfg["rope_parameters"]["rope_type"] == "default"
    model = random_model.build_model(config, "bfloat16", device="meta")  # shapes only, nothing allocated
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama-3-8B's count
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_smollm2_135m_has_the_embedded_models_shape():
    import gguf

    from jaxserve.checkpoints.gguf_loader import gguf_config
    from jaxserve.checkpoints import embedded_model_path

    config = random_model.hf_config("smollm2-135m")
    cfg = config.to_dict()
    reader = gguf.GGUFReader(embedded_model_path())   # metadata only: tensors stay on disk (mmap)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    embedded = gguf_config({**metadata, "tokenizer.ggml.tokens": ()}, [t.name for t in reader.tensors])
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")
    assert {k: cfg[k] for k in keys} == {k: embedded[k] for k in keys}
    assert cfg["head_dim"] == embedded["head_dim"] == 64
    assert cfg["rms_norm_eps"] == pytest.approx(embedded["rms_norm_eps"])
    assert cfg["rope_parameters"]["rope_theta"] == embedded["rope_theta"] == 100000.0
    assert cfg["initializer_range"] == 0.04   # see random_model's docstring: clear greedy margins
    model = random_model.build_model(config, "float32", device="meta")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008   # SmolLM2-135M's count (tied)


def test_the_tokenizer_is_padded_to_the_model_vocabulary():
    from jaxserve.bench.corpus import corpus_text

    tok = random_model.make_tokenizer(1000)
    assert len(tok) == 1000
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok(corpus_text(50))["input_ids"]
    assert max(ids) < random_model.TRAINED_VOCAB  # encoding never produces a reserved token
    assert tok.decode([999]) == "<|reserved_999|>"
    assert len(random_model.make_tokenizer(384)) == 384  # tiny: the trained BPE alone, as before


def test_the_cli_writes_a_complete_directory_and_then_reuses_it(tmp_path, capsys):
    out = str(tmp_path / "m")
    assert random_model.main([out]) == 0
    with open(os.path.join(out, random_model.MARKER)) as f:
        assert json.load(f) == {"shape": "tiny", "dtype": "float32", "seed": 0}
    assert not os.path.exists(out + ".partial")
    assert random_model.main([out]) == 0
    assert "reusing" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        random_model.main([str(foreign)])
    assert (foreign / "notes.txt").exists()


def test_decode_read_bytes_counts_every_weight_but_the_input_embedding(tiny_model_dir):
    sizes = gpu_summary.safetensors_sizes(tiny_model_dir)
    params = 384 * 64 * 2 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64  # untied, f32
    assert sum(sizes.values()) == 4 * params
    assert gpu_summary.decode_read_bytes(tiny_model_dir) == 4 * (params - 384 * 64)


@pytest.mark.parametrize("name, label, peak", [
    ("NVIDIA H200", "H200", 4.8e12),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 3.35e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 2.0e12),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", None),
    ("", "unknown GPU", None),
])
def test_hbm_bandwidth_comes_from_the_gpu_name(name, label, peak):
    assert gpu_summary.hbm_bandwidth(name) == (label, peak)


def test_summary_lines_divide_weight_bytes_by_tpot(tiny_model_dir):
    latency = {"subcommand": "latency", "runs": [], "extra": {"latency_sweep": {
        "jaxserve": [{"batch_size": 1, "tpot_median_s": 0.004}], "hf": [{"batch_size": 1, "tpot_median_s": 0.02}]}}}
    throughput = {"subcommand": "throughput", "workload": {"num_requests": 8, "total_prompt_tokens": 256,
                                                           "total_output_tokens": 128},
                  "runs": [{"backend": "jaxserve", "metrics": {"output_throughput": 1500.0, "total_throughput": 4500.0}}]}
    lines = gpu_summary.summary_lines([latency, throughput], tiny_model_dir, "NVIDIA H200")
    read = gpu_summary.decode_read_bytes(tiny_model_dir)
    assert lines[0].endswith("H200 peak HBM bandwidth 4.80 TB/s")
    jx = next(line for line in lines if line.startswith("gpu_bench: jaxserve:"))
    assert "batch-1 TPOT 4.00 ms (250.0 tok/s)" in jx and f"{read / 0.004 / 1e6:.2f} MB/s" in jx
    assert "saturation 1,500.0 output tok/s" in jx
    hf = next(line for line in lines if line.startswith("gpu_bench: hf:"))
    assert "TPOT 20.00 ms" in hf and "saturation n/a" in hf


def test_run_from_checkout_maps_the_packages_without_the_install():
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        "for m in [m for m in sys.modules if m.startswith(('jaxserve', '__editable'))]: del sys.modules[m]\n"
        "try:\n"
        "    import jaxserve.sched\n"
        "    raise SystemExit('jaxserve.sched imported without the mapping')\n"
        "except ModuleNotFoundError:\n"
        "    pass\n"
        "from jaxserve.bench.run_from_checkout import map_packages\n"
        "map_packages()\n"
        "import jaxserve.sched.block_pool, jaxserve.checkpoints, sched\n"
        "print(jaxserve.sched.__file__, jaxserve.checkpoints.__file__, sched.__file__)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert res.returncode == 0, res.stderr
    mapped_sched, mapped_ckpt, stdlib_sched = res.stdout.split()
    assert mapped_sched == os.path.join(REPO, "sched", "__init__.py")
    assert mapped_ckpt == os.path.join(REPO, "checkpoints", "__init__.py")
    assert not stdlib_sched.startswith(REPO)  # the folder sched/ does not shadow the standard library


def _script_engine_flags() -> list[list[str]]:
    """The jaxserve engine flags the script passes, one list per model shape (JAX_DEFAULT=...)."""
    import re
    import shlex

    text = open(SCRIPT).read()
    return [shlex.split(m) for m in re.findall(r'JAX_DEFAULT="([^"]*)"', text)]


def test_the_scripts_engine_flags_make_valid_step_shapes():
    # the first GPU run lost its jaxserve steps to prefill_buckets=(0,32) for a 64-tile budget:
    # the flags are checked here the way the engine checks them, without building one
    import argparse

    from jaxserve.bench.args import engine_kwargs
    from jaxserve.engine_args import engine_config
    from jaxserve.engine.builder import runner_shapes
    from jaxserve.llm import OFFLINE_PREFILL_TILE

    flag_sets = _script_engine_flags()
    assert len(flag_sets) == 2     # llama3-8b and the tiny dry run
    for flags in flag_sets:
        p = argparse.ArgumentParser()
        for name in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--num-kv-blocks"):
            p.add_argument(name, type=int)
        p.add_argument("--engine-arg", action="append", default=[])
        args = p.parse_args(flags)
        kw = {k: v for k, v in engine_kwargs(argparse.Namespace(dtype="bfloat16", **vars(args))).items()}
        max_len = kw.pop("max_model_len")
        kw.setdefault("prefill_tile", OFFLINE_PREFILL_TILE)    # the bench builds an LLM
        shapes = runner_shapes(engine_config(**kw, max_model_len=max_len), max_len)
        assert shapes.prefill_buckets[0] == 0 and len(shapes.buckets()) == 4, (flags, shapes.buckets())


def test_run_from_checkout_runs_another_checkouts_code_whatever_is_installed(tmp_path):
    """--checkout DIR: every jaxserve package comes from DIR, even run from this checkout (the
    working directory) with this checkout's editable install, and with DIR's launcher an older
    one that kept whatever `jaxserve.sched` the install mapped."""
    old_launcher = subprocess.run(["git", "show", "00a19cb:jaxserve/bench/run_from_checkout.py"], cwd=REPO,
                                  capture_output=True, text=True)
    if old_launcher.returncode != 0:
        pytest.skip("no git history here")
    other = tmp_path / "other"
    for folder in ("jaxserve/bench", "sched", "checkpoints", "cpu_kernels"):
        (other / folder).mkdir(parents=True)
        (other / folder / "__init__.py").write_text("")
    (other / "jaxserve" / "__init__.py").write_text("")
    (other / "jaxserve" / "bench" / "run_from_checkout.py").write_text(old_launcher.stdout)
    (other / "jaxserve" / "probe.py").write_text(
        "import jaxserve, jaxserve.sched, jaxserve.checkpoints, cpu_kernels, sched\n"
        "print(jaxserve.__file__, jaxserve.sched.__file__, jaxserve.checkpoints.__file__, cpu_kernels.__file__,"
        " sched.__file__)\n")
    res = subprocess.run([sys.executable, "-m", "jaxserve.bench.run_from_checkout", "--checkout", str(other),
                          "jaxserve.probe"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    *ours, stdlib_sched = res.stdout.split()
    assert all(p.startswith(str(other) + os.sep) for p in ours), ours
    assert not stdlib_sched.startswith(str(other))   # the checkout's sched/ is mapped, not on the path


def test_a_checkouts_own_launcher_maps_its_own_folders_beside_another_install(tmp_path):
    """Run from a checkout with its own (this) launcher, `jaxserve.sched` is the checkout's, not
    the folder the editable install of another checkout maps."""
    other = tmp_path / "other"
    for folder in ("jaxserve/bench", "sched", "checkpoints"):
        (other / folder).mkdir(parents=True)
        (other / folder / "__init__.py").write_text("")
    shutil.copy(os.path.join(REPO, "jaxserve", "bench", "run_from_checkout.py"), other / "jaxserve" / "bench")
    (other / "jaxserve" / "probe.py").write_text("import jaxserve.sched\nprint(jaxserve.sched.__file__)\n")
    res = subprocess.run([sys.executable, "-m", "jaxserve.bench.run_from_checkout", "jaxserve.probe"], cwd=other,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(other / "sched" / "__init__.py")
