"""A kept executable that loads but fails its first run never stops a start: warm-up drops its
cache entries, compiles the step and its sampler, and runs it again on a fresh arena."""

import jax

from jaxserve import LLM
from jaxserve.runner import warmup

from tests.conftest import TINY_ENGINE


def test_a_step_that_fails_its_first_run_is_compiled_again_and_the_start_goes_on(tiny_llama_dir, tmp_path,
                                                                                   monkeypatch):
    config = {**TINY_ENGINE, "cache_dir": str(tmp_path)}
    LLM(tiny_llama_dir, **config)                      # fills the executable cache
    real_step = warmup.warm_up_step
    failed, recompiled = [], []

    def failing_once(shapes, bucket):
        if not failed:
            failed.append(bucket)
            raise jax.errors.JaxRuntimeError("INTERNAL: Function compare_select_fusion not found (type id: 1)")
        return real_step(shapes, bucket)

    monkeypatch.setattr(warmup, "warm_up_step", failing_once)
    from jaxserve.runner.model_runner import ModelRunner
    real_recompile = ModelRunner.recompile
    monkeypatch.setattr(ModelRunner, "recompile", lambda self, b: (recompiled.append(b), real_recompile(self, b)))
    llm = LLM(tiny_llama_dir, **config)
    assert recompiled == failed and len(failed) == 1
    outs = llm.generate([{"prompt_token_ids": list(range(3, 20))}], use_tqdm=False)
    assert outs[0].finished
