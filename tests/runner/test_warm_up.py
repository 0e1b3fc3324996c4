"""Start-up runs every compiled bucket once, on scratch blocks, so no request pays a first run."""

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE


def test_warm_up_runs_every_bucket_once_and_leaves_the_engine_whole(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **TINY_ENGINE)
    runner = llm.engine.runner
    runs = {bucket: 0 for bucket in runner._compiled}
    assert (2, 0) in runs and (4, 0) in runs and (4, 4) in runs   # decode-only and mixed buckets

    def counting(bucket, step):
        def call(*args):
            runs[bucket] += 1
            return step(*args)
        return call

    runner._compiled = {b: counting(b, s) for b, s in runner._compiled.items()}
    runner.warm_up(progress=False)
    assert runs == {b: 1 for b in runs}
    stats = llm.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert stats.num_requests_running == stats.num_requests_waiting == 0
    out = llm.generate([{"prompt_token_ids": list(range(3, 60))}], SamplingParams(max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert llm.stats().num_compilations_after_warmup == 0
