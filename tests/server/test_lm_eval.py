"""lm-eval-harness against `jaxserve serve --http-port --enable-prompt-logprobs`: its
`local-completions` model on a small multiple-choice task written here (a task YAML and a JSON
file, nothing from a hub), tokenizing through the server's /tokenize and /detokenize (lm-eval's
remote tokenizer). Every choice's loglikelihood equals HF transformers' on the same weights
(float32) and so does the accuracy. The command is the one docs/server.md shows."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.testing.tiny_models import hf_logprobs
from tests.server.server_process import ServerProcess, free_port

DOCS = [
    {"question": "The tide comes in", "choices": ["twice a day", "once a year", "with the moon"], "answer": 0},
    {"question": "def add(a, b):", "choices": ["return a + b", "print(a)", "pass"], "answer": 0},
    {"question": "A paged KV cache stores keys", "choices": ["and values", "in blocks", "of fixed size"],
     "answer": 0},
    {"question": "Numbers: 0 1 2 3", "choices": ["4 5 6", "42 100", "2026"], "answer": 0},
    {"question": "Continuous batching lets new requests", "choices": ["join", "decode", "wait"], "answer": 0},
    {"question": "Unicode: café,", "choices": ["naïve", "東京", "emoji"], "answer": 1},
]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def lm_eval_command(base_url: str, model: str, tasks_dir: str, out_dir: str) -> list[str]:
    """The command docs/server.md shows (lm-eval's CLI), for this server and task folder."""
    return [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
            "--model_args", f"base_url={base_url}/v1/completions,model={model},tokenizer_backend=remote,"
                            "num_concurrent=1,max_retries=1",
            "--include_path", tasks_dir, "--tasks", "tiny_mc", "--output_path", out_dir, "--log_samples"]


def hf_loglikelihood(path: str, tok, context: str, continuation: str) -> float:
    """lm-eval's pairing: the whole text's ids, the context's ids a prefix of them, the rest the
    continuation (no special tokens: what its remote tokenizer asks /tokenize for)."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    lp = hf_logprobs(path, whole)
    return float(sum(lp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


@pytest.mark.slow
def test_lm_eval_local_completions_matches_hf(tiny_llama_dir, xla_cache_dir, tmp_path):
    pytest.importorskip("lm_eval")
    data = tmp_path / "tasks" / "tiny_mc.json"
    data.parent.mkdir()
    data.write_text("\n".join(json.dumps(d) for d in DOCS))
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(TASK.format(data=data))
    port = free_port()
    srv = ServerProcess(tiny_llama_dir, xla_cache_dir, tmp_path / "server.log", "--http-port", str(port),
                        "--enable-prompt-logprobs")
    try:
        srv.wait_serving()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "OPENAI_API_KEY": "none"}
        out = tmp_path / "out"
        run = subprocess.run(lm_eval_command(f"http://127.0.0.1:{port}", os.path.basename(tiny_llama_dir),
                                             str(tmp_path / "tasks"), str(out)),
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        assert srv.terminate() == 0, srv.log()
    finally:
        srv.kill()
    samples = [json.loads(line) for f in glob.glob(str(out / "**" / "samples_tiny_mc_*.jsonl"), recursive=True)
               for line in open(f)]
    results = json.load(open(glob.glob(str(out / "**" / "results_*.json"), recursive=True)[0]))
    assert len(samples) == len(DOCS)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    hits = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        doc = s["doc"]
        got = [float(r[0][0]) for r in s["resps"]]       # one (loglikelihood, is_greedy) per choice
        want = [hf_loglikelihood(tiny_llama_dir, tok, doc["question"], " " + c) for c in doc["choices"]]
        assert got == pytest.approx(want, abs=1e-4), doc
        hits.append(int(np.argmax(want)) == doc["answer"])
        assert s["acc"] == hits[-1]
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(np.mean(hits))
