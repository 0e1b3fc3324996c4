"""Random PEFT adapters of the session's tiny Llama (tests/conftest.py), written once per session:
different ranks, target modules, alphas and scalings, each with a random (non-zero) lora_B."""

import pytest

# name -> (rank, alpha, target modules, rsLoRA)
ADAPTERS = {
    "qv4": (4, 8.0, ("q_proj", "v_proj"), False),
    "all8": (8, 12.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), True),
    "mlp2": (2, 3.0, ("o_proj", "up_proj", "down_proj"), False),
    "kq3": (3, 5.0, ("k_proj", "q_proj", "gate_proj"), False),
}

# the tiny engine on few buckets (each one compiles), serving 3 adapter slots of rank 8
LORA_ENGINE = dict(max_num_seqs=4, max_model_len=128, block_size=4, prefill_tile=8, max_num_batched_tokens=32,
                   num_kv_blocks=96, swap_space=1 << 20, xla_optimization_level=0, compilation_cache_dir="",
                   cache_dir="", progress=False, long_prefill_token_threshold=0, decode_buckets=(4,),
                   decode_only_buckets=(1, 4), prefill_buckets=(0, 4), enable_lora=True, max_loras=3,
                   max_lora_rank=8)


@pytest.fixture(scope="session")
def adapter_dirs(tiny_llama_dir, tmp_path_factory):
    from jaxserve.testing.lora_adapters import make_peft_adapter

    root = tmp_path_factory.mktemp("lora-adapters")
    return {name: make_peft_adapter(tiny_llama_dir, root / name, r=r, alpha=alpha, target_modules=targets,
                                    use_rslora=rs, seed=i + 1)
            for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items())}
