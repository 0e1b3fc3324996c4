"""A GGUF model as a Hugging Face float32 directory, for engines that read only HF checkpoints.

eSurge (EasyDeL) loads config.json + safetensors, not GGUF. transformers dequantizes the GGUF
(the embedded SmolLM2 is Q4_1) to float32 exactly as the `hf` backend does when it loads it, and
`save_pretrained` writes that: so every backend of a run sees the same float32 weights. The
conversion takes seconds but is kept, keyed by the GGUF's sha256, under
`$XDG_CACHE_HOME/jaxserve/` (default ~/.cache/jaxserve/); an HF directory is used as it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from jaxserve.bench.model_files import ModelSpec, files_sha256

_DONE_MARK = "jaxserve-export.txt"  # written last inside the temp dir: a directory without it is partial


def cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxserve")


def export_dir(spec: ModelSpec, root: str | None = None) -> str:
    """Where the HF copy of `spec` lives (or would): the spec's own folder for an HF directory."""
    if spec.kind == "hf":
        return spec.directory
    stem = os.path.splitext(spec.gguf_file or os.path.basename(spec.path))[0]
    stem = stem.split(".")[0].lower()  # "SmolLM2-135M-Instruct.Q4_1" -> "smollm2-135m-instruct"
    digest = files_sha256(spec).removeprefix("sha256:")[:12]
    return os.path.join(root or cache_root(), f"{stem}-hf-float32-{digest}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, _DONE_MARK))


def ensure_hf_dir(spec: ModelSpec, root: str | None = None) -> str:
    """The HF float32 directory for `spec`, converting once. Written to a temp dir beside the
    target and renamed, so a crash or a second process never leaves a half-written cache entry."""
    target = export_dir(spec, root)
    if spec.kind == "hf" or is_complete(target):
        return target
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(target) + ".tmp-", dir=parent)
    try:
        _convert(spec, tmp)
        with open(os.path.join(tmp, _DONE_MARK), "w") as f:
            f.write(f"converted from {spec.path}\n{files_sha256(spec)}\nfloat32 by transformers\n")
        if os.path.isdir(target):      # an older partial copy (no mark): replace it
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):  # anything but "another process finished first" is an error
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(spec: ModelSpec, out: str) -> None:
    from jaxserve.bench.hf_loading import load_hf_model
    from jaxserve.bench.model_files import load_tokenizer

    model = load_hf_model(spec, "float32").to("cpu")
    # transformers marks a GGUF-loaded model as "quantized with gguf" and refuses to save it, but
    # its tensors are already dequantized float32: drop the marks and save those plain tensors.
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(spec).save_pretrained(out)
