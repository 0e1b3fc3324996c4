"""Policy-gradient RL with jaxserve in one process: the engine samples, plain JAX trains, the
engine takes the new weights, repeat.

    python examples/rl_policy_gradient.py [--steps 30] [--model PATH]

Each step:
1. rollouts: `llm.generate` samples n completions per prompt (temperature 1), with the logprob of
   every sampled token: the engine runs with `logprobs_mode="processed"`, so these are the
   logprobs of the distribution each token was actually drawn from;
2. reward: the share of a completion's tokens that fall in a fixed target set of token ids, a
   rule a tiny random model learns within a few dozen steps;
3. REINFORCE with a baseline: each completion's advantage is its reward less the mean reward of
   its prompt's n samples; the loss is -mean(advantage x logprob) over the completion tokens,
   whose logprobs come from `jaxserve.reference_logprobs` (the same model function on the whole
   sequence, dense attention, differentiable); one Adam step in plain JAX;
4. `llm.update_weights(new_params, version=step)`: the engine serves the new weights from its
   next step, nothing compiles.

Each step prints the mean reward and the rollout-vs-replay gap: the largest |engine logprob -
replay logprob| over the sampled tokens, under the weights that sampled them. The engine's paged,
bucketed step and the replay's dense forward compute the same function with other reductions, so
the gap is float32 rounding (about 1e-6 on the tiny model), not a bug; an importance ratio
exp(replay - rollout) stays 1 to that precision.

Without --model it trains a tiny random-weight Llama (jaxserve/testing/tiny_models.py, needs
torch to write it), small engine shapes so it runs on a CPU in a minute or so.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import LLM, SamplingParams, reference_logprobs

# Small shapes: 16 seats (2 prompts x 8 samples), one decode bucket and one mixed bucket of 2
# prefill tiles, so start-up compiles two steps.
ENGINE = dict(max_num_seqs=16, max_model_len=64, block_size=4, prefill_tile=8, max_num_batched_tokens=16,
              decode_buckets=(16,), prefill_buckets=(0, 2), num_kv_blocks=160, long_prefill_token_threshold=0,
              logprobs_mode="processed")

PROMPTS = [[5, 17, 42, 99, 7, 23, 64, 11], [150, 3, 88, 201, 9, 250, 31, 77]]   # token ids


def make_llm(model: str, **overrides) -> LLM:
    return LLM(model, **{**ENGINE, **overrides})


def target_ids(vocab_size: int, count: int = 32, seed: int = 0) -> np.ndarray:
    """The token ids the reward counts: a fixed random set."""
    return np.sort(np.random.default_rng(seed).choice(vocab_size, count, replace=False))


def adam(lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8):
    """Adam in plain JAX: (init(params) -> state, update(grads, state, params) -> (params, state))."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return (zeros, zeros, jnp.zeros((), jnp.int32))

    def update(grads, state, params):
        m, v, t = state
        t = t + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        scale = lr * jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        params = jax.tree.map(lambda p, m, v: (p - scale * m / (jnp.sqrt(v) + eps)).astype(p.dtype), params, m, v)
        return params, (m, v, t)

    return init, update


def make_train_step(llm: LLM, opt_update):
    def loss(params, tokens, mask, advantages):
        """tokens [B, T]; mask [B, T - 1]: 1 where the token after the position is a completion
        token; advantages [B]."""
        lp = reference_logprobs(llm, params, tokens)                                      # [B, T - 1]
        return -jnp.sum(advantages[:, None] * lp * mask) / jnp.sum(mask), lp

    @jax.jit
    def train_step(params, opt_state, tokens, mask, advantages):
        (value, lp), grads = jax.value_and_grad(loss, has_aux=True)(params, tokens, mask, advantages)
        params, opt_state = opt_update(grads, opt_state, params)
        return params, opt_state, value, lp

    return train_step


def rollout_batch(outputs, prompts, width: int, pad_id: int = 0):
    """The sampled sequences as arrays: tokens [B, width] (prompt + completion, right-padded),
    mask [B, width - 1] (the positions whose next token is a completion token), rollout logprobs
    [B, width - 1] (0 elsewhere), completions and each one's prompt index."""
    seqs, group, completions, rollout_lp = [], [], [], []
    for i, (out, prompt) in enumerate(zip(outputs, prompts)):
        for c in out.outputs:
            seqs.append((prompt, c.token_ids))
            group.append(i)
            completions.append(c.token_ids)
            rollout_lp.append([entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)])
    b = len(seqs)
    tokens = np.full((b, width), pad_id, np.int32)
    mask = np.zeros((b, width - 1), np.float32)
    lp = np.zeros((b, width - 1), np.float32)
    for j, (prompt, completion) in enumerate(seqs):
        p, n = len(prompt), len(completion)
        tokens[j, :p + n] = list(prompt) + list(completion)
        mask[j, p - 1:p - 1 + n] = 1.0
        lp[j, p - 1:p - 1 + n] = rollout_lp[j]
    return tokens, mask, lp, completions, np.array(group)


def train(llm: LLM, *, steps: int, prompts: list[list[int]], n: int = 8, max_tokens: int = 8, lr: float = 1e-2,
          log=print) -> list[dict]:
    """The RL loop; returns one record per step: mean reward, rollout-vs-replay gap, seconds."""
    targets = target_ids(llm.engine.runner.model_config.vocab_size)
    is_target = np.zeros(llm.engine.runner.model_config.vocab_size, bool)
    is_target[targets] = True
    params = llm.engine.runner.params        # the engine's pytree: what update_weights takes back
    opt_init, opt_update = adam(lr)
    opt_state = opt_init(params)
    train_step = make_train_step(llm, opt_update)
    width = max(len(p) for p in prompts) + max_tokens
    sampling = SamplingParams(n=n, temperature=1.0, logprobs=0, max_tokens=max_tokens, ignore_eos=True)
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        tokens, mask, rollout_lp, completions, group = rollout_batch(outputs, prompts, width)
        rewards = np.array([is_target[c].mean() for c in completions], np.float32)
        baseline = np.array([rewards[group == g].mean() for g in group], np.float32)
        advantages = rewards - baseline
        params, opt_state, loss, replay_lp = train_step(params, opt_state, tokens, mask, advantages)
        # the replay's logprobs are of the weights that sampled (computed before the update)
        gap = float(np.max(np.abs(np.asarray(replay_lp) - rollout_lp) * mask))
        llm.update_weights(params, version=step + 1)
        record = dict(step=step, reward=float(rewards.mean()), gap=gap, loss=float(loss),
                      seconds=time.perf_counter() - t0)
        history.append(record)
        log(f"step {step:3d}  reward {record['reward']:.3f}  rollout-vs-replay max|dlogprob| {gap:.2e}  "
            f"loss {record['loss']:+.4f}  {record['seconds']:.2f} s")
    return history


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint to train (default: a tiny random Llama written to a temp dir)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from jaxserve.testing.tiny_models import make_tiny_model

        model = make_tiny_model(tempfile.mkdtemp(prefix="rl-tiny-"), "llama", seed=0)
    llm = make_llm(model)
    history = train(llm, steps=args.steps, prompts=PROMPTS, n=args.n, max_tokens=args.max_tokens, lr=args.lr)
    first, last = history[:5], history[-5:]
    print(f"mean reward: first 5 steps {np.mean([h['reward'] for h in first]):.3f}, "
          f"last 5 steps {np.mean([h['reward'] for h in last]):.3f}; "
          f"largest rollout-vs-replay gap {max(h['gap'] for h in history):.2e}; "
          f"compilations after warm-up: {llm.stats().steps.num_compilations_after_warmup}")
    return history


if __name__ == "__main__":
    main()
