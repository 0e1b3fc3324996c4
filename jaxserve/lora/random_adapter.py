"""Random LoRA adapters in PEFT's file format, from numpy alone (no torch, no peft, no files
from anywhere): what `jaxserve bench lora` serves, and what tests use to write adapters with a
chosen defect. Shapes come from the model's projections (lora/targets.py)."""

from __future__ import annotations

import json
import os

import numpy as np

from jaxserve.lora.peft_adapter import CONFIG_FILE, WEIGHTS_FILE
from jaxserve.lora.targets import LoRATargets


def write_random_adapter(path: str | os.PathLike, targets: LoRATargets, *, r: int, alpha: float,
                         target_modules: tuple[str, ...], seed: int = 0, use_rslora: bool = False,
                         scale: float = 0.05) -> str:
    """Write `adapter_config.json` and `adapter_model.safetensors` for every module of the model
    whose short name is in `target_modules`, lora_A and lora_B drawn N(0, scale)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, part in targets.parts.items():
        if name.rsplit(".", 1)[-1] not in target_modules:
            continue
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, scale, (r, part.in_features)).astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, scale, (part.out_features, r)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(target_modules),
              "use_rslora": use_rslora, "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
              "fan_in_fan_out": False, "modules_to_save": None, "use_dora": False}
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    return str(path)
