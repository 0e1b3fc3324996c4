"""Random-weight Llama models in a Hugging Face directory, for tests and speed benchmarks.

Decoding speed does not depend on the weight values, so a model with random weights and a real
model's shape measures what the real model would (at exact output lengths with EOS ignored, as
the benchmarks run). Nothing is downloaded: the tokenizer is a byte-level BPE trained on the
bench corpus (jaxserve/bench/corpus.py).

Shapes:
  tiny       the model the bench tests use: vocab 384, hidden 64, 2 layers, 4 heads (2 KV heads)
  small      a few milliseconds per decode step of 32 sequences on our CPU, where the engine's
             host work per step is of the same order (bench overlap): vocab 384, hidden 256,
             intermediate 768, 6 layers, 8 heads (4 KV heads)
  llama3-8b  Llama-3-8B's shape: vocab 128,256, hidden 4096, intermediate 14,336, 32 layers,
             32 heads (8 KV heads), rope theta 500,000; about 8.03 B parameters (16 GB in bfloat16)
  smollm2-135m
             the embedded SmolLM2-135M's shape: vocab 49,152, hidden 576, intermediate 1536,
             30 layers, 9 heads (3 KV heads, head_dim 64), tied embeddings, rope theta 100,000;
             134.5 M parameters. Weights drawn with std 0.04: at the default 0.02 thirty random
             layers repeat a handful of tokens, at 0.1-0.2 they amplify rounding (fp32 logits
             1e-3 from fp64's at 0.2) until greedy choices hinge on it; at 0.04 greedy output
             varies and fp32 logits stay within about 1e-5 of fp64's (scripts/gpu_parity_check.py)

The BPE is trained to at most TRAINED_VOCAB tokens; when the model's vocabulary is larger, the
tokenizer's vocabulary is padded with `<|reserved_N|>` tokens up to the model's size (as
Llama-3 reserves special tokens), so every id a random model samples decodes to text, and
prompt ids stay in range.

Command line (progress on stderr; an existing complete directory of the same build is reused):

    python -m jaxserve.bench.random_model --shape llama3-8b --dtype bfloat16 --device cuda OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any, Iterable

from jaxserve.models import registry

TRAINED_VOCAB = 384
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")       # ids 0, 1, 2
MARKER = "random_model.json"                    # written last: the directory is complete

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, initializer_range=0.2,
    ),
    "small": dict(
        vocab_size=384, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=False, initializer_range=0.2,
    ),
    "llama3-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=100000.0),
        tie_word_embeddings=True, initializer_range=0.04,
    ),
}
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")


def hf_config(shape: str = "tiny", vocab_size: int | None = None, model_type: str = "llama") -> Any:
    """The transformers config of a shape (its class from the model registry); bos/eos/pad are
    the tokenizer's <s>, </s>, <pad>."""
    config_cls, _ = registry.transformers_classes(model_type)

    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} must be one of {', '.join(SHAPES)}")
    kwargs = dict(SHAPES[shape])
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    return config_cls(**kwargs, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE trained on `texts` with <pad>, <s>, </s> as ids 0, 1, 2 (a tokenizers.Tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)   # its progress is blank lines on a non-terminal
    tok.train_from_iterator(texts, trainer)
    return tok


def fast_tokenizer(tok: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def pad_vocab(tok: Any, vocab_size: int) -> Any:
    """`tok` with its BPE vocabulary extended by `<|reserved_N|>` tokens (N = id) up to vocab_size.

    No merge produces them, so encoding never does; decoding one gives its text."""
    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<|reserved_{i}|>"] = i
    return Tokenizer.from_str(json.dumps(spec))


def make_tokenizer(model_vocab_size: int) -> Any:
    """The corpus BPE (PreTrainedTokenizerFast), padded to the model's vocabulary if that is larger."""
    from jaxserve.bench.corpus import corpus_text

    tok = bpe_tokenizer(corpus_text(200).split("\n\n"), min(model_vocab_size, TRAINED_VOCAB))
    if tok.get_vocab_size() < model_vocab_size:
        tok = pad_vocab(tok, model_vocab_size)
    return fast_tokenizer(tok)


def build_model(config: Any, dtype: str = "float32", seed: int = 0, device: str = "cpu") -> Any:
    """The config's causal LM (its class from the model registry) with random weights, created
    directly in `dtype` on `device`."""
    import torch

    _, model_cls = registry.transformers_classes(config.model_type)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def make_random_hf_model(directory: str, shape: str = "tiny", dtype: str = "float32", seed: int = 0,
                         device: str = "cpu", vocab_size: int | None = None,
                         log: Any = None) -> str:
    """Save a random-weight Llama of `shape` (safetensors) and its tokenizer under `directory`.

    device="cuda" creates the weights on the GPU (seconds for 8 B parameters, against minutes on
    the CPU); they are moved to the host to be saved. `vocab_size` overrides the shape's.
    Returns `directory`.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r} must be one of {', '.join(DEVICES)}")
    say = log or (lambda msg: None)
    config = hf_config(shape, vocab_size)
    os.makedirs(directory, exist_ok=True)
    t = time.perf_counter()
    make_tokenizer(config.vocab_size).save_pretrained(directory)
    say(f"tokenizer written ({time.perf_counter() - t:.1f} s)")

    t = time.perf_counter()
    model = build_model(config, dtype, seed, device)
    n = sum(p.numel() for p in model.parameters())
    say(f"{shape}: {n:,} parameters in {dtype} created on {device} ({time.perf_counter() - t:.1f} s)")
    if device != "cpu":
        t = time.perf_counter()
        model = model.to("cpu")
        say(f"moved to the host ({time.perf_counter() - t:.1f} s)")
    t = time.perf_counter()
    model.save_pretrained(directory, safe_serialization=True)
    say(f"saved to {directory} ({time.perf_counter() - t:.1f} s)")
    return directory


def _complete(directory: str, build: dict[str, Any]) -> bool:
    try:
        with open(os.path.join(directory, MARKER)) as f:
            return json.load(f) == build
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxserve.bench.random_model",
                                description="Write a random-weight Llama (HF directory) for benchmarks.")
    p.add_argument("out_dir")
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where the weights are created")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR already holds this build")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(f"random_model: {msg}", file=sys.stderr, flush=True)

    out = os.path.abspath(args.out_dir)
    build = {"shape": args.shape, "dtype": args.dtype, "seed": args.seed}
    if not args.force and _complete(out, build):
        log(f"reusing {out} ({build})")
        return 0
    # build next to the target and rename at the end: a killed build never looks complete
    if os.path.exists(out) and not os.path.exists(os.path.join(out, MARKER)) and os.listdir(out):
        p.error(f"{out} exists and was not written by this command; give a new or empty directory")
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    make_random_hf_model(partial, args.shape, args.dtype, args.seed, args.device, log=log)
    with open(os.path.join(partial, MARKER), "w") as f:
        json.dump(build, f)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    log(f"done: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
