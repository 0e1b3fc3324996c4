"""Run inside a child process with N CPU devices (tests/parallel/cpu_devices.py): expert
parallelism's checks, one JSON report as the last stdout line. The tests assert on the report;
nothing here decides pass or fail.

    ep_probe.py layer [fast|full]         both dispatch forms (parallel/experts.py) against the
                                          one-device layer (models/moe.py) on routings chosen to
                                          be hard: random, experts with no token, one expert
                                          taking every token, every token on one shard
    ep_probe.py engine DIR EP:TP:FORM ... per setting an engine's greedy outputs (three prompts, one
                                          of them chunked, then one reading its cached prefix)
                                          and its compiled steps' collectives
    ep_probe.py quantized DIR ONE_GROUP_DIR   int8 / int4 experts split, and int4 refused where a
                                          device would hold half a quantization group
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.models.moe import ExpertWeights, Routing, moe_mlp
from jaxserve.parallel.experts import DISPATCH_FORMS, ExpertParallel, experts_specs
from jaxserve.parallel.layout import split_columns_order
from jaxserve.parallel.mesh import make_moe_mesh

NUM_EXPERTS, HIDDEN, COLUMNS, TOP_K = 8, 32, 16, 2


def routings(rng, tokens: int) -> dict[str, Routing]:
    def weights():
        w = rng.random((tokens, TOP_K)).astype(np.float32) + 0.1
        return jnp.asarray(w / w.sum(1, keepdims=True))

    def of(ids):
        return Routing(expert_ids=jnp.asarray(ids, jnp.int32), weights=weights())

    random = np.stack([rng.permutation(NUM_EXPERTS)[:TOP_K] for _ in range(tokens)])
    few = np.stack([rng.permutation(3)[:TOP_K] for _ in range(tokens)])            # experts 3..7 get none
    one = np.stack([np.full(tokens, 5), rng.choice([0, 1, 2, 3, 4, 6, 7], tokens)], 1)   # expert 5 takes all
    last_shard = np.stack([np.full(tokens, 7), np.full(tokens, 6)], 1)             # all on the last shard
    return {"random": of(random), "empty_experts": of(few), "one_takes_all": of(one), "one_shard": of(last_shard)}


def layer(scope: str = "full") -> dict:
    """scope "fast": a decode-sized and a prefill-sized step at EP 4 and at EP 2 x TP 2; "full":
    also one token, EP 2 and TP 2 alone. One compile per (tokens, mesh, form); the routings are
    its inputs."""
    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((NUM_EXPERTS, HIDDEN, 2 * COLUMNS)) * 0.2).astype(np.float32)
    down = (rng.standard_normal((NUM_EXPERTS, COLUMNS, HIDDEN)) * 0.2).astype(np.float32)
    one_device = ExpertWeights({"kernel": jnp.asarray(gate_up)}, {"kernel": jnp.asarray(down)})
    sizes = (5, 64) if scope == "fast" else (1, 5, 64)    # an odd count (all_to_all pads), a prefill
    meshes = ((4, 1), (2, 2)) if scope == "fast" else ((1, 2), (2, 1), (4, 1), (2, 2))
    report = []
    for tokens in sizes:
        x = jnp.asarray(rng.standard_normal((tokens, HIDDEN)), jnp.float32)
        cases = routings(rng, tokens)
        wants = {case: np.asarray(moe_mlp(x, r, one_device, activation=jax.nn.silu)) for case, r in cases.items()}
        for ep, tp in meshes:
            mesh = make_moe_mesh(ep, tp)
            host = ExpertWeights({"kernel": gate_up[..., split_columns_order((COLUMNS, COLUMNS), tp)]},
                                 {"kernel": down})
            placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), host, experts_specs(host))
            for form in DISPATCH_FORMS:
                run = jax.jit(lambda x, r, w, form=form, mesh=mesh: ExpertParallel(mesh, form)(
                    x, r, w, activation=jax.nn.silu))
                for case, routing in cases.items():
                    got = np.asarray(run(x, routing, placed))
                    report.append({"tokens": tokens, "case": case, "ep": ep, "tp": tp, "form": form,
                                   "max_abs_err": float(np.max(np.abs(got - wants[case]))),
                                   "max_abs": float(np.max(np.abs(wants[case])))})
    return {"devices": jax.device_count(), "checks": report}


def engine(model_dir: str, *settings: str) -> dict:
    from jaxserve import LLM, SamplingParams
    from jaxserve.parallel.collectives import collectives
    from tests.parallel.tp_probe import TINY_PROMPTS, TINY_SHAPES

    greedy = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    report = {}
    for setting in settings:
        ep, tp, form = setting.split(":")
        llm = LLM(model_dir, **TINY_SHAPES, tensor_parallel_size=int(tp), expert_parallel_size=int(ep),
                  expert_dispatch=form)
        outputs = [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, greedy)]
        # the long prompt again with a tail: its cached blocks are read back (a prefix hit)
        outputs += [o.outputs[0].token_ids for o in llm.generate([TINY_PROMPTS[2] + " once more"], greedy)]
        runner = llm.engine.runner
        steps = {}
        for bucket in ((4, 0), (4, 4)):
            runner.load_executables([bucket])
            steps[str(bucket)] = [[c.kind, c.dtype, list(c.shape)] for c in
                                  collectives(runner.steps[bucket].as_text())]
        report[setting] = {"outputs": outputs, "collectives": steps,
                           "mesh": {k: int(v) for k, v in runner.mesh.shape.items()} if runner.mesh else None,
                           "compilations_after_warmup": llm.engine.stats().steps.num_compilations_after_warmup,
                           "prefix_cache_hits": llm.engine.stats().scheduler.prefix_cache_hits}
        del llm, runner
    return {"devices": jax.device_count(), "engines": report}


def quantized(model_dir: str, one_group_dir: str) -> dict:
    """int8 and int4 (group 32) experts at EP 1 and at EP 2 x TP 2 on `model_dir`; int4 on
    `one_group_dir`, whose experts' 32 columns are one group, at TP 2 (refused: a device would
    unpack half a group)."""
    from jaxserve import LLM, SamplingParams
    from tests.parallel.tp_probe import TINY_PROMPTS, TINY_SHAPES

    greedy = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    report = {}
    for mode in ("int8", "int4"):
        for ep, tp in ((1, 1), (2, 2)):
            llm = LLM(model_dir, **TINY_SHAPES, tensor_parallel_size=tp, expert_parallel_size=ep, quantization=mode,
                      quantization_group_size=32)
            report[f"{mode}:{ep}:{tp}"] = [o.outputs[0].token_ids for o in llm.generate(TINY_PROMPTS, greedy)]
            del llm
    try:
        LLM(one_group_dir, **TINY_SHAPES, tensor_parallel_size=2, quantization="int4", quantization_group_size=32)
        report["refused"] = None
    except ValueError as e:
        report["refused"] = str(e)
    return report


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    result = {"layer": layer, "engine": engine, "quantized": quantized}[mode](*args)
    print(json.dumps(result))
