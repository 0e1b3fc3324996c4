"""What an adapter may target in a model: its projections' parts, read from the architecture's
tensor declaration (models/tensor_layout.py), so every architecture in the registry gets the same
table without restating it.

A PEFT adapter names its tensors after the HF modules (`model.layers.3.self_attn.q_proj`); in the
params they are parts of fused projections (q | k | v in `layers_3/self_attn/qkv_proj`, gate | up
in `layers_3/mlp/gate_up_proj`). A `PartTarget` maps one to the other; mixture-of-experts
experts are not projections here, so an adapter targeting them is refused by name.

Under tensor parallelism a column-parallel fused projection stores its output columns shard-major
(parallel/layout.py: whole heads per shard, KV heads replicated where the shards outnumber them):
`ModuleTarget.columns` is that order, the natural columns each stored column is, so a slot's
lora_b is laid out exactly as the base kernel and the delta splits with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.models.tensor_layout import COLUMN, Path, TensorLayout


@dataclass(frozen=True, slots=True)
class PartTarget:
    path: Path              # the params module (a fused projection)
    index: int              # which of its parts
    in_features: int
    out_features: int
    column: int             # the part's first output column in the fused projection


@dataclass(frozen=True)
class ModuleTarget:
    path: Path
    in_features: int
    parts: tuple[tuple[str, int], ...]     # (HF name, output features), in fused order
    parallel: str = COLUMN                 # the projection's split under tensor parallelism
    columns: np.ndarray | None = None      # stored column -> natural column (shard-major), or None

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def stored_out_features(self) -> int:
        """Output columns as the params store them (more than out_features with replicated KV heads)."""
        return self.out_features if self.columns is None else len(self.columns)


@dataclass(frozen=True)
class LoRATargets:
    modules: dict[Path, ModuleTarget]
    parts: dict[str, PartTarget]           # HF module name -> where it lives

    @classmethod
    def from_layout(cls, layout: TensorLayout, heads=None) -> "LoRATargets":
        """heads: the tensor-parallel HeadLayout (parallel/layout.py) the params are stored in, or None."""
        from jaxserve.parallel.layout import split_columns_order

        modules, parts = {}, {}
        for path, proj in layout.projections():
            columns = None
            if heads is not None and proj.shard_major is not None:
                columns = (heads.qkv_columns() if proj.shard_major == "qkv"
                           else split_columns_order(tuple(n for _, n in proj.parts), heads.shards))
            modules[path] = ModuleTarget(path, proj.in_features, tuple(proj.parts), proj.parallel, columns)
            column = 0
            for i, (name, n) in enumerate(proj.parts):
                parts[name] = PartTarget(path, i, proj.in_features, n, column)
                column += n
        return cls(modules, parts)

    @property
    def short_names(self) -> frozenset[str]:
        """The module names an adapter_config's target_modules may list (q_proj, down_proj, ...)."""
        return frozenset(name.rsplit(".", 1)[-1] for name in self.parts)
