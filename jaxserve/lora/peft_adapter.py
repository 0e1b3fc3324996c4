"""Reading a PEFT LoRA adapter directory and checking it against the served model.

A directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`, `use_rslora`,
...) and `adapter_model.safetensors`, whose tensors are named after the HF modules they adapt:
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. The delta of a
module is x @ A^T @ B^T * scale, scale = alpha / r, or alpha / sqrt(r) with rsLoRA (r being the
module's own rank: `rank_pattern` may give modules different ranks, which their tensors' shapes
say).

Everything that could not be served exactly is a ValueError naming it, before anything reaches
the device: a module the model has no projection for (the target list, or a tensor's name), a
rank above the engine's `max_lora_rank`, factors whose shapes are not the module's, and the PEFT
features the slots do not compute (DoRA, trained biases, modules_to_save, per-module alphas,
embedding adapters, fan_in_fan_out).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from jaxserve.lora.targets import LoRATargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_FACTORS = {"lora_A.weight": "a", "lora_B.weight": "b"}


@dataclass(frozen=True)
class ModuleFactors:
    a: np.ndarray          # [r, in] float32 (PEFT's lora_A)
    b: np.ndarray          # [out, r] float32 (PEFT's lora_B)
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    path: str
    rank: int                                  # the largest module rank
    factors: dict[str, ModuleFactors]          # HF module name -> its factors

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({name.rsplit(".", 1)[-1] for name in self.factors}))


class AdapterFilesMissing(FileNotFoundError, ValueError):
    """No PEFT adapter at the path (no directory, or one without its files): a ValueError as any
    bad adapter is, and a FileNotFoundError, which the HTTP load route answers with a 404."""


def load_peft_adapter(path: str, targets: LoRATargets, max_rank: int) -> PeftAdapter:
    """The adapter at `path`, checked against the model's `targets` and `max_rank`."""
    if not path or not os.path.isdir(path):
        raise AdapterFilesMissing(f"LoRA adapter path {path!r} is not a directory")
    cfg_file, weights_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(cfg_file):
        raise AdapterFilesMissing(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    if not os.path.isfile(weights_file):
        raise AdapterFilesMissing(f"LoRA adapter {path!r} has no {WEIGHTS_FILE} (only safetensors adapters are read)")
    with open(cfg_file) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not JSON ({e})") from None
    _check_config(path, cfg, targets)
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rslora = bool(cfg.get("use_rslora", False))

    from safetensors.numpy import load_file

    try:
        tensors = load_file(weights_file)
    except Exception as e:   # a truncated or foreign file: safetensors' own message says which
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} cannot be read ({e})") from None
    halves: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        module, factor = _split_key(path, key)
        if module not in targets.parts:
            raise ValueError(f"LoRA adapter {path!r} targets {module!r}, which this model has no projection "
                             f"for (it serves adapters on {', '.join(sorted(targets.short_names))})")
        halves.setdefault(module, {})[factor] = np.asarray(value, dtype=np.float32)
    if not halves:
        raise ValueError(f"LoRA adapter {path!r} holds no lora_A / lora_B tensors")
    factors = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"a", "b"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_{'A' if 'a' in pair else 'B'} "
                             f"but no lora_{'B' if 'a' in pair else 'A'}")
        a, b = pair["a"], pair["b"]
        part = targets.parts[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA adapter {path!r}: {module} lora_A {a.shape} and lora_B {b.shape} "
                             f"are not [r, in] and [out, r] of one rank")
        r = a.shape[0]
        if a.shape[1] != part.in_features or b.shape[0] != part.out_features:
            raise ValueError(f"LoRA adapter {path!r}: {module} is [out={b.shape[0]}, in={a.shape[1]}] in the "
                             f"adapter but [out={part.out_features}, in={part.in_features}] in the model "
                             f"(an adapter trained on another base model?)")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: {module} has rank {r}, above max_lora_rank={max_rank} "
                             f"(start the engine with max_lora_rank >= {r})")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        factors[module] = ModuleFactors(a, b, scale)
    return PeftAdapter(path, max(f.rank for f in factors.values()), factors)


def _check_config(path: str, cfg: dict, targets: LoRATargets) -> None:
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not LORA")
    refused = {
        "use_dora": bool(cfg.get("use_dora")),
        "bias": cfg.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
    }
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ValueError(f"LoRA adapter {path!r} uses {', '.join(bad)}, which LoRA slots do not compute "
                         f"(plain low-rank deltas on the model's projections only)")
    listed = cfg.get("target_modules")
    if isinstance(listed, (list, tuple)):      # a string is a pattern: the tensors' names are checked instead
        unknown = sorted(set(listed) - targets.short_names)
        if unknown:
            raise ValueError(f"LoRA adapter {path!r} targets {unknown}, which this model has no projection "
                             f"for (it serves adapters on {', '.join(sorted(targets.short_names))})")


def _split_key(path: str, key: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (module, "a")."""
    for suffix, factor in _FACTORS.items():
        if key.endswith("." + suffix) and key.startswith(_PREFIX):
            return key[len(_PREFIX):-len(suffix) - 1], factor
    raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a lora_A / lora_B weight of a module "
                     f"(embedding adapters, DoRA magnitudes and saved modules are not served)")
