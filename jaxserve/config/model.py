"""What is served: the checkpoint, its dtype and quantization, the context length, the chat
template, and the optional outputs a step computes (prompt logprobs, embeddings)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.options import check_choice, check_positive_int, choices, option
from jaxserve.quant.spec import LM_HEAD_MODES, QUANTIZATION_MODES


@dataclass(frozen=True, slots=True)
class ServedModelConfig:
    model: str | None = option(
        None, "GGUF file, HF directory or converted checkpoint; default: the embedded SmolLM2-135M-Instruct")
    dtype: str = option("auto", "weights and KV cache dtype: auto (float32 on CPU, bfloat16 on GPU), float32, "
                                "bfloat16", choices=("auto", "float32", "bfloat16"))
    quantization: str = option(
        "none", "weight quantization of the decoder projections: none (serve the checkpoint as it is), int8 "
                "(per output channel), int4 (group-wise, --quantization-group-size), fp8 (e4m3 weights and "
                "activations, activation scales calibrated on real text), w8a8 (int8 weights and int8 activations "
                "per token, smoothed with per-channel ranges calibrated on real text: the fast form on CPUs); "
                "embedding, LM head and norms stay float (w8a8 and int4: see --quantize-lm-head)",
        choices=QUANTIZATION_MODES)
    quantize_lm_head: bool = option(
        False, "w8a8 / int4: the LM head in that form too (w8a8: smoothed like the projections; int4: the "
               "projections' groups); a tied embedding keeps a float copy for the lookup. On a CPU the float head "
               "is a large part of a small model's decode step")
    quantization_group_size: int = option(32, "int4: inputs per scale (32 or 128)")
    calibration_data: str | None = option(
        None, "text file the fp8 activation scales, w8a8's smoothing and fp8/int8 KV cache scales are calibrated "
              "on (default: a built-in public-domain text)")
    max_model_len: int | None = option(None, "longest prompt + output in tokens; default: the model's limit, at "
                                             "most 8192")
    seed: int = option(0, "seed for requests that bring none", per_engine=True)
    chat_template: str | None = option(
        None, "a Jinja chat template (a file, or the template text) used instead of the model's own: e.g. one "
              "that renders tools for a model whose template does not")
    enable_prompt_logprobs: bool = option(
        False, "serve SamplingParams.prompt_logprobs (and /v1/completions echo with logprobs, lm-eval's "
               "loglikelihood): the steps also return their hidden states and one more small function per step "
               "row count is compiled at start-up (the LM head, log_softmax, top-k); off, a request asking for "
               "them is refused at the door and nothing more is compiled")
    enable_embeddings: bool = option(
        False, "serve embeddings (LLM.embed, /v1/embeddings, the Embed RPC): the steps also return their hidden "
               "states (as for prompt logprobs) and one more small function per step row count is compiled at "
               "start-up (the pooled sums); off, an embedding request is refused and nothing more is compiled")

    def __post_init__(self) -> None:
        if self.chat_template:   # checked before anything loads: a bad one fails the start in a moment
            from jaxserve.engine.chat_template import load_chat_template

            load_chat_template(self.chat_template)
        for name in ("dtype", "quantization"):
            check_choice(self, name, choices(self, name))
        if self.quantization_group_size not in (32, 128):
            raise ValueError(f"quantization_group_size={self.quantization_group_size!r} must be 32 or 128")
        if self.quantize_lm_head and self.quantization not in LM_HEAD_MODES:
            raise ValueError(f"quantize_lm_head=True needs quantization in {LM_HEAD_MODES} "
                             f"(got {self.quantization!r})")
        check_positive_int(self, "max_model_len", optional=True)
