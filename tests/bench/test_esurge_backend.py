"""The esurge bench backend: the driver's protocol, the GGUF -> HF cache's paths, the clear skips
where the eSurge venv or easydel is missing, and (slow, where scripts/esurge/setup.sh has run)
greedy tokens that start as jaxserve's on the embedded model in float32."""

import ast
import json
import os
import subprocess
import sys

import pytest

from jaxserve.bench import esurge_driver as drv
from jaxserve.bench import hf_export
from jaxserve.bench.backend_base import RunOptions, UnsupportedBackend
from jaxserve.bench.backend_esurge import DRIVER, ESurgeBackend, esurge_venv, model_len_for
from jaxserve.bench.model_files import ModelSpec, resolve_model
from jaxserve.bench.workloads import BenchRequest


def _run_line(**over):
    obj = {"cmd": "run", "max_concurrency": 2,
           "requests": [{"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 4},
                        {"id": "b", "prompt_token_ids": [5], "max_tokens": 1}]}
    obj.update(over)
    return json.dumps(obj)


def test_commands_parse_into_their_dataclasses():
    load = drv.parse_command(json.dumps({"cmd": "load", "model_dir": "/m", "max_model_len": 256,
                                         "max_num_seqs": 8, "max_num_batched_tokens": None}))
    assert load == drv.LoadCommand("/m", 256, 8)                  # defaults: float32, v2 attention
    assert load.attn_mechanism == "ragged_page_attention_v2"
    run = drv.parse_command(_run_line())
    assert run.max_concurrency == 2
    assert run.requests == (drv.RunRequest("a", (1, 2, 3), 4), drv.RunRequest("b", (5,), 1))
    assert drv.parse_command(_run_line(max_concurrency=None)).max_concurrency is None
    assert drv.parse_command('{"cmd": "quit"}') == drv.QuitCommand()


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ("[1]", "JSON object"),
    ('{"cmd": "stop"}', "unknown command"),
    ('{"cmd": "load", "max_model_len": 8, "max_num_seqs": 1}', "model_dir"),
    ('{"cmd": "load", "model_dir": "/m", "max_model_len": 0, "max_num_seqs": 1}', "max_model_len"),
    ('{"cmd": "load", "model_dir": "/m", "max_model_len": 8, "max_num_seqs": true}', "max_num_seqs"),
    ('{"cmd": "load", "model_dir": "/m", "max_model_len": 8, "max_num_seqs": 1, "dtype": "int8"}', "dtype"),
    ('{"cmd": "load", "model_dir": "/m", "max_model_len": 8, "max_num_seqs": 1, "hbm_utilization": 2}',
     "hbm_utilization"),
    ('{"cmd": "run", "requests": []}', "non-empty"),
    (_run_line(max_concurrency=0), "max_concurrency"),
    (_run_line(requests=[{"id": "a", "prompt_token_ids": [], "max_tokens": 1}]), "prompt_token_ids"),
    (_run_line(requests=[{"id": "a", "prompt_token_ids": [1, -2], "max_tokens": 1}]), "prompt_token_ids"),
    (_run_line(requests=[{"id": "a", "prompt_token_ids": [1], "max_tokens": 0}]), "max_tokens"),
    (_run_line(requests=[{"id": "a", "prompt_token_ids": [1], "max_tokens": 1}] * 2), "twice"),
])
def test_malformed_commands_are_refused_with_what_is_wrong(line, message):
    with pytest.raises(drv.ProtocolError, match=message):
        drv.parse_command(line)


def test_events_are_one_json_line_each():
    line = drv.encode({"event": "done", "id": "a", "token_ids": [1, 2]})
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line) == {"event": "done", "id": "a", "token_ids": [1, 2]}


def test_the_driver_imports_nothing_of_jaxserve():
    # it runs in the eSurge venv, where jaxserve is not installed
    tree = ast.parse(open(DRIVER).read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert names and not [n for n in names if n.split(".")[0] == "jaxserve"]


def test_without_easydel_the_driver_says_so_on_its_protocol_channel():
    # jaxserve's own venv has no easydel: the driver's first (and only) line is that error
    out = subprocess.run([sys.executable, DRIVER], input="", capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 1 and len(lines) == 1
    event = json.loads(lines[0])
    assert event["event"] == "error" and event["import_failed"] and "easydel" in event["message"]


def _hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return ModelSpec(str(d), "hf", str(d), None)


def test_a_missing_venv_is_skipped_with_the_setup_command(tmp_path):
    with pytest.raises(UnsupportedBackend, match="bash scripts/esurge/setup.sh"):
        ESurgeBackend(_hf_dir(tmp_path), venv=str(tmp_path / "no-venv"))


def test_a_venv_without_easydel_is_skipped_with_the_setup_command(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")   # jaxserve's python: no easydel there
    with pytest.raises(UnsupportedBackend, match=r"easydel does not import.*bash scripts/esurge/setup.sh"):
        ESurgeBackend(_hf_dir(tmp_path), venv=str(venv))


def test_the_venv_is_where_setup_puts_it_unless_told(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXSERVE_ESURGE_VENV", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert esurge_venv() == str(tmp_path / "jaxserve" / "esurge-venv")
    monkeypatch.setenv("JAXSERVE_ESURGE_VENV", "/elsewhere")
    assert esurge_venv() == "/elsewhere"


def test_max_model_len_is_the_workload_in_whole_pages_unless_given():
    assert model_len_for(192, {}) == 256
    assert model_len_for(128, {}) == 128
    assert model_len_for(129, {}) == 256
    assert model_len_for(192, {"max_model_len": 300}) == 300


def test_sampled_workloads_and_timed_arrivals_are_refused():
    backend = object.__new__(ESurgeBackend)       # no driver needed to refuse
    greedy, sampled = BenchRequest("a", (1, 2), 4), BenchRequest("b", (1, 2), 4, temperature=0.7)
    with pytest.raises(UnsupportedBackend, match="greedily"):
        backend.run([greedy, sampled], RunOptions(progress=False))
    with pytest.raises(UnsupportedBackend, match="request-rate inf"):
        backend.run([greedy], RunOptions(progress=False, timed_arrivals=True))


def _gguf(tmp_path, name="SmolLM2-135M-Instruct.Q4_1.gguf", data=b"GGUF-1"):
    d = tmp_path / "models"
    d.mkdir(exist_ok=True)
    (d / name).write_bytes(data)
    return ModelSpec(str(d / name), "gguf", str(d), name)


def test_the_cache_dir_is_named_by_the_model_and_keyed_by_its_bytes(tmp_path):
    root = str(tmp_path / "cache")
    one = hf_export.export_dir(_gguf(tmp_path), root)
    assert os.path.dirname(one) == root
    assert os.path.basename(one).startswith("smollm2-135m-instruct-hf-float32-")
    other = hf_export.export_dir(_gguf(tmp_path, "other.gguf", b"GGUF-2"), root)
    assert one.rsplit("-", 1)[1] != other.rsplit("-", 1)[1]     # other bytes, other key
    hf = _hf_dir(tmp_path)
    assert hf_export.export_dir(hf, root) == hf.directory       # an HF directory is used as it is
    assert hf_export.ensure_hf_dir(hf, root) == hf.directory


def test_a_finished_conversion_is_reused_and_a_partial_one_redone(tmp_path, monkeypatch):
    spec, root = _gguf(tmp_path), str(tmp_path / "cache")
    calls = []

    def fake_convert(s, out):
        calls.append(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(hf_export, "_convert", fake_convert)
    target = hf_export.export_dir(spec, root)
    os.makedirs(target)
    open(os.path.join(target, "config.json"), "w").close()       # left by a crash: no done mark
    assert hf_export.ensure_hf_dir(spec, root) == target
    assert len(calls) == 1 and calls[0] != target                 # written elsewhere, then renamed
    assert hf_export.is_complete(target)
    assert hf_export.ensure_hf_dir(spec, root) == target and len(calls) == 1   # cached: not again
    assert os.listdir(root) == [os.path.basename(target)]         # no temp dir left behind


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    spec, root = _gguf(tmp_path), str(tmp_path / "cache")

    def broken(s, out):
        open(os.path.join(out, "config.json"), "w").close()
        raise RuntimeError("disk full")

    monkeypatch.setattr(hf_export, "_convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        hf_export.ensure_hf_dir(spec, root)
    assert os.listdir(root) == []


@pytest.mark.slow
def test_greedy_tokens_start_as_jaxserve_on_the_embedded_model_in_float32():
    if not os.access(os.path.join(esurge_venv(), "bin", "python"), os.X_OK):
        pytest.skip(f"no eSurge venv at {esurge_venv()}: bash scripts/esurge/setup.sh")
    from jaxserve import LLM, SamplingParams

    spec = resolve_model(None)
    prompts = [(1, 504, 3458, 282, 4649, 314), (1, 9690, 198, 19556, 314, 260, 2567)]
    requests = [BenchRequest("a", prompts[0], 10), BenchRequest("b", prompts[1], 6)]
    backend = ESurgeBackend(spec, {"max_num_seqs": 2}, max_seq_len=128)
    try:
        run = backend.run(requests, RunOptions(max_concurrency=2, progress=False))
    finally:
        backend.close()
    assert [r.output_len for r in run.records] == [10, 6]
    assert all(len(r.token_times) == r.output_len for r in run.records)
    llm = LLM(spec.path, max_model_len=128, max_num_seqs=2, dtype="float32", progress=False)
    ours = llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (10, 6)],
                        use_tqdm=False)
    ours = {"a": list(ours[0].outputs[0].token_ids), "b": list(ours[1].outputs[0].token_ids)}
    # Not all equal (2026-12-07): "b" agreed on 5 of 6 tokens ([282, 1488, 338, 314, 441] then 2294
    # against jaxserve's 3917), "a" on its first 6 at least. Both run float32 on the same weights,
    # so that is eSurge's arithmetic (its ragged_page_attention_v2 loop, XLA's reductions) against
    # jaxserve's; a wiring error (prompt ids, greedy, EOS) would differ from the first token.
    assert run.output_token_ids["a"][:5] == ours["a"][:5]
    assert run.output_token_ids["b"][:5] == ours["b"][:5]
