"""Tensor parallelism on tiny random models, on 8 CPU devices in one child process
(cpu_devices.py says why a child): Llama at 2 and 4 devices, Mistral at 4, Qwen2 at 8, Qwen3 at 2,
Gemma 2 and Gemma 3 (sliding and global layers, soft caps, two RoPE bases) at 2.
The models have 8 query heads and 2 KV heads, so 4 and 8 devices replicate KV heads. All engines
keep their executables in one folder, as a server's persistent cache would. Mistral's engine runs
the Triton kernel and Qwen3's the Mosaic kernel (in their interpreters, as on a CPU they must),
each per shard inside shard_map like the XLA attention the others run.

Each engine's greedy outputs (and n=2 forks) must equal HF transformers' greedy continuations,
which the one-device engine equals (tests/engine/test_llm_tiny.py): building a one-device engine
per model here would double the test's time for the same comparison. Its compiled steps must
hold exactly the designed collectives; each device must hold 1/N of every split weight and of the
KV arena, measured from the arrays' shards."""

import pytest

from jaxserve.testing.tiny_models import make_tiny_model
from tests.parallel.cpu_devices import run_probe

SIZES = {"llama": (2, 4), "mistral": (4,), "qwen2": (8,), "qwen3": (2,), "gemma2": (2,), "gemma3": (2,)}
ATTENTION = {"mistral": "triton_interpret", "qwen3": "mosaic_interpret"}      # the rest: auto (XLA)
HEADS, KV_HEADS = 8, 2
TILE = 8          # tp_probe.TINY_SHAPES' prefill tile
NORMS = ("norm/weight",)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    specs = []
    for arch, sizes in SIZES.items():
        path = make_tiny_model(tmp_path_factory.mktemp(f"tp-{arch}"), arch, seed=1, num_heads=HEADS,
                               num_kv_heads=KV_HEADS)
        specs.append(f"{path}:{','.join(map(str, sizes))}:{ATTENTION.get(arch, 'auto')}")
    result = run_probe(8, "tiny", str(tmp_path_factory.mktemp("tp-cache")), *specs)
    assert result["devices"] == 8
    return {arch: model for arch, model in zip(SIZES, result["models"].values())}


def engines(report):
    """(arch, size, the model's report, the engine's report)"""
    for arch, sizes in SIZES.items():
        for size in sizes:
            yield arch, size, report[arch], report[arch]["engines"][str(size)]


def test_greedy_outputs_and_forks_are_identical_to_one_device(report):
    for arch, size, model, split in engines(report):
        assert [len(t) for t in model["hf_tokens"]] == [12] * 3
        assert split["tokens"] == model["hf_tokens"], (arch, size)
        assert split["forked"] == [model["hf_tokens"][0][:8]] * 2, (arch, size)
        assert split["compilations_after_warmup"] == 0


def test_mesh_is_reported(report):
    for arch, size, _model, split in engines(report):
        assert split["mesh"] == {"num_devices": size, "num_hosts": 1, "axis_sizes": {"data": 1, "model": size},
                                 "device_kind": split["mesh"]["device_kind"]}


def test_step_holds_one_all_reduce_after_attention_and_one_after_the_mlp_per_layer(report):
    """Per layer 2 all-reduces of [T, D]; one more for the vocabulary-split embedding lookup; one
    all-gather, of the sampled rows' logits [R, V]; nothing else (no weight or KV all-gather)."""
    for arch, size, model, split in engines(report):
        layers, hidden, vocab = model["layers"], model["hidden"], model["vocab"]
        assert split["collectives"], (arch, size)
        for bucket, ops in split["collectives"].items():
            decodes, tiles = map(int, bucket.split(","))
            rows = decodes + tiles * TILE
            sample_rows = 4 if tiles == 0 else 8      # the power of two holding D + P
            reduces = [shape for kind, _, shape in ops if kind == "all-reduce"]
            gathers = [shape for kind, _, shape in ops if kind == "all-gather"]
            others = [kind for kind, _, _ in ops if kind not in ("all-reduce", "all-gather")]
            assert reduces == [[rows, hidden]] * (2 * layers + 1), (arch, size, bucket, ops)
            assert gathers == [[sample_rows, vocab]], (arch, size, bucket, ops)
            assert others == [], (arch, size, bucket)


def test_each_device_holds_one_nth_of_the_weights_and_of_the_kv_arena(report):
    for arch, size, model, split in engines(report):
        one = model["one_device"]
        kv_replicas = max(KV_HEADS, size) // KV_HEADS
        for leaf in split["params"]:
            held = leaf["per_device"]
            assert held[size:] == [0] * (8 - size), leaf["path"]          # devices outside the mesh hold nothing
            if leaf["path"].endswith(NORMS):
                assert held[:size] == [leaf["nbytes"]] * size, leaf["path"]   # replicated: tiny
            else:
                assert held[:size] == [leaf["nbytes"] // size] * size, (arch, size, leaf)
        # the split weights are the one-device weights, plus the KV heads' replicated columns
        total = one["params"]
        assert sorted(total) == sorted(leaf["path"] for leaf in split["params"])
        for leaf in split["params"]:
            extra = 0
            if leaf["path"].endswith("qkv_proj/kernel"):
                head_bytes = leaf["nbytes"] // (HEADS + 2 * KV_HEADS * kv_replicas)
                extra = 2 * KV_HEADS * (kv_replicas - 1) * head_bytes
            elif leaf["path"].endswith("qkv_proj/bias"):
                extra = 2 * KV_HEADS * (kv_replicas - 1) * (leaf["nbytes"] // (HEADS + 2 * KV_HEADS * kv_replicas))
            assert leaf["nbytes"] == total[leaf["path"]] + extra, leaf["path"]
        # KV arena: same blocks, heads split (and replicated first when the devices outnumber them)
        assert split["kv_heads"] == KV_HEADS * kv_replicas
        assert split["kv_total"] == one["kv_total"] * kv_replicas
        assert split["kv_per_device"] == [split["kv_total"] // size] * size + [0] * (8 - size)


def test_the_executable_cache_keeps_each_mesh_size_apart(report):
    """Llama at 4 devices after Llama at 2, sharing one executable cache: it kept new executables
    (its keys differ) and its outputs are right (an executable of the 2-way mesh would not run)."""
    two, four = report["llama"]["engines"]["2"], report["llama"]["engines"]["4"]
    new = set(four["executables_kept"]) - set(two["executables_kept"])
    assert len(new) >= 2                      # its two steps at least (and its samplers)
    assert four["tokens"] == report["llama"]["hf_tokens"]
