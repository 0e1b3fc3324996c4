"""examples/rl_policy_gradient.py, a short run on the tiny random Llama: the mean reward rises
within 10 policy-gradient steps, every step's rollout logprobs (logprobs_mode="processed") match
the replay of the weights that sampled them, the updates compile nothing; and processed logprobs
at another temperature are the replay's at that temperature (raw ones would not be)."""

import jax
import jax.numpy as jnp
import numpy as np

from examples import rl_policy_gradient as ex
from jaxserve import SamplingParams, reference_logprobs

STEPS = 10
# the engine's paged, bucketed float32 step against the dense replay: measured up to 7.6e-6
GAP_TOLERANCE = 1e-4


def test_reward_rises_and_rollout_logprobs_are_the_replays(tiny_llama_dir):
    llm = ex.make_llm(tiny_llama_dir, xla_optimization_level=0, compilation_cache_dir="", cache_dir="",
                      progress=False)
    assert llm.engine.runner.logprobs_mode == "processed"
    lines = []
    history = ex.train(llm, steps=STEPS, prompts=ex.PROMPTS, log=lines.append)
    rewards = [h["reward"] for h in history]
    print("\n".join(lines))
    # measured: 0.102 0.062 0.086 ... 0.742 0.930 0.906 (chance: 32 of 320 ids, 0.1)
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.15, rewards
    assert max(h["gap"] for h in history) < GAP_TOLERANCE, [h["gap"] for h in history]
    assert llm.weights_version == STEPS
    assert llm.stats().steps.num_compilations_after_warmup == 0

    # processed logprobs at temperature 0.5 are the replay's at 0.5, not the model's own (raw)
    outs = llm.generate([{"prompt_token_ids": p} for p in ex.PROMPTS],
                        SamplingParams(n=8, temperature=0.5, logprobs=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    width = len(ex.PROMPTS[0]) + 8
    tokens, mask, rollout_lp, _, _ = ex.rollout_batch(outs, ex.PROMPTS, width)
    replay = jax.jit(lambda p, ids: jnp.stack([reference_logprobs(llm, p, ids, temperature=t) for t in (0.5, 1.0)]))
    at_half, at_one = np.asarray(replay(llm.engine.runner.params, tokens))
    assert np.max(np.abs(at_half - rollout_lp) * mask) < GAP_TOLERANCE
    assert np.max(np.abs(at_one - rollout_lp) * mask) > 0.1
