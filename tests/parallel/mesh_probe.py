"""Run inside a child process with 4 CPU devices (tests/parallel/cpu_devices.py): engines on
sub-meshes a caller owns (LLM(mesh=...)), as beside a trainer holding the other devices. Prints
one JSON report as its last stdout line; the tests assert on it.

    mesh_probe.py DIR      a 1-D mesh named "tp" over devices 2 and 3, then a one-device mesh on
                           device 1: greedy outputs (with HF transformers' beside them), where the
                           params, the arena and every buffer the engine made live, sleep(1) and
                           wake_up on the 2-device engine; engine_mesh's mapping and refusals
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve import LLM, SamplingParams
from jaxserve.parallel.mesh import engine_mesh
from jaxserve.parallel.sharding import bytes_on_each_device
from tests.parallel.tp_probe import TINY_PROMPTS, TINY_SHAPES

GREEDY = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)


def live_buffers() -> dict[tuple[int, int], int]:
    """(device id, buffer address) -> bytes, for every live device buffer (each once)."""
    return {(s.device.id, s.data.unsafe_buffer_pointer()): s.data.nbytes
            for a in jax.live_arrays() for s in a.addressable_shards}


def per_device(buffers: dict) -> dict[int, int]:
    out: dict[int, int] = {}
    for (device, _), n in buffers.items():
        out[device] = out.get(device, 0) + n
    return out


def devices_of(tree) -> list[int]:
    return sorted({d.id for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set})


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)]


def refusal(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return ""


def mapping() -> dict:
    d = jax.devices()
    square = np.array(d).reshape(2, 2)
    return {
        "named": [x.id for x in
                  engine_mesh(Mesh(np.array([d[3], d[1]]).reshape(1, 2), ("data", "model"))).devices.flat],
        "by_axis": [x.id for x in engine_mesh(Mesh(np.array(d[:2]).reshape(2, 1), ("tp", "dp")), "tp").devices.flat],
        "square": refusal(lambda: engine_mesh(Mesh(square, ("data", "model")))),
        "square_by_axis": refusal(lambda: engine_mesh(Mesh(square, ("dp", "tp")), "tp")),
        "unnamed": refusal(lambda: engine_mesh(Mesh(square, ("dp", "tp")))),
    }


def main(model_dir: str) -> dict:
    d = jax.devices()
    report = {"devices": len(d), "mapping": mapping()}
    before = live_buffers()
    llm = LLM(model_dir, mesh=Mesh(np.array(d[2:4]), ("tp",)), **TINY_SHAPES)
    runner = llm.engine.runner
    out = tokens(llm)
    made = {k: n for k, n in live_buffers().items() if k not in before}
    report["sub"] = {
        "tokens": out,
        "prompts": [o.prompt_token_ids for o in llm.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)],
        "params_devices": devices_of(runner.params),
        "arena_devices": devices_of(runner.kv_caches),
        "made_on": sorted(per_device(made)),
        "mesh": runner.mesh_info.as_dict(),
        "tensor_parallel_size": llm.config.parallel.tensor_parallel_size,
    }
    arena, weights = bytes_on_each_device(runner.kv_caches), bytes_on_each_device(runner.params)
    scratch = bytes_on_each_device(runner.scratch_arrays())
    live = per_device(live_buffers())
    slept = llm.sleep(1)
    after = per_device(live_buffers())
    report["sub"]["sleep"] = {
        "kv_cache_bytes": slept.kv_cache_bytes, "weight_bytes": slept.weight_bytes,
        "bytes_per_device": {str(k): v for k, v in slept.bytes_per_device},
        "measured_per_device": {str(k): arena.get(k, 0) + weights.get(k, 0) + scratch.get(k, 0)
                                for k in sorted(set(arena) | set(weights) | set(scratch))},
        "arena_bytes": sum(arena.values()), "weight_bytes_measured": sum(weights.values()),
        "live_dropped": {str(x.id): live.get(x.id, 0) - after.get(x.id, 0) for x in d},
    }
    woke = llm.wake_up()
    report["sub"]["woke"] = {"kv_cache_bytes": woke.kv_cache_bytes, "weight_bytes": woke.weight_bytes,
                             "tokens": tokens(llm), "params_devices": devices_of(runner.params),
                             "arena_devices": devices_of(runner.kv_caches)}
    report["sub"]["compilations_after_warmup"] = llm.stats().steps.num_compilations_after_warmup
    del llm, runner

    llm = LLM(model_dir, mesh=Mesh(np.array(d[1:2]), ("tp",)), **TINY_SHAPES)
    runner = llm.engine.runner
    report["one"] = {"tokens": tokens(llm), "params_devices": devices_of(runner.params),
                     "arena_devices": devices_of(runner.kv_caches), "mesh": runner.mesh_info.as_dict(),
                     "compilations_after_warmup": llm.stats().steps.num_compilations_after_warmup}
    del llm, runner

    from jaxserve.testing.tiny_models import hf_greedy
    report["hf_tokens"] = [hf_greedy(model_dir, ids, 12) for ids in report["sub"]["prompts"]]
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
