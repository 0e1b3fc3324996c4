"""An architecture's tensors, declared once: what a checkpoint holds, what the params tree holds,
how each splits over a tensor-parallel mesh and which projections quantize. No jax here (the
checkpoint loaders read it on the host).

An architecture's registry row (models/registry.py) maps a config to a `TensorLayout`: one entry
per params module, keyed by its path in the params tree (("layers_0", "self_attn", "qkv_proj")):

    Projection   a linear layer: the HF weights it fuses along its outputs ([out, in] each, in
                 order), its input width, column- or row-parallel, its bias, whether it may be
                 quantized, and the shard-major reorder of its fused columns ("qkv": whole heads
                 per shard; "split": each part's columns cut evenly; parallel/layout.py)
    ExpertProjection  a mixture-of-experts projection stacked over its experts ([E, in, out]),
                 from per-expert HF weights (names with "{e}"); split by expert over a mesh
    Weight       any other tensor (a norm, the embedding, an untied LM head): its HF name and
                 shape, its leaf name, transposed or not, and its split (replicated or by
                 vocabulary rows / columns)

Everything that used to restate the architecture derives from it: the HF shapes a checkpoint
must have (checkpoints/layout.py), the params' shapes (models/params.py), their PartitionSpecs
(parallel/sharding.py), the HF names quantization may replace (quant/checkpoint.py), random
weights and conversion from HF tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

Path = tuple[str, ...]

COLUMN, ROW = "column", "row"
REPLICATED, VOCAB_ROWS, VOCAB_COLUMNS = "replicated", "vocab_rows", "vocab_columns"


@dataclass(frozen=True, slots=True)
class Projection:
    parts: tuple[tuple[str, int], ...]    # (HF name without ".weight", output features), fused in order
    in_features: int
    parallel: str                         # COLUMN (split on outputs) or ROW (split on inputs)
    bias: bool = False                    # "<part>.bias" for every part
    quantize: bool = True                 # quantization may replace its weights
    shard_major: str | None = None        # COLUMN only: "qkv" (heads) or "split" (each part evenly)

    def __post_init__(self) -> None:
        if self.parallel not in (COLUMN, ROW):
            raise ValueError(f"parallel={self.parallel!r} must be {COLUMN!r} or {ROW!r}")
        if self.shard_major is not None and (self.parallel != COLUMN or self.shard_major not in ("qkv", "split")):
            raise ValueError(f"shard_major={self.shard_major!r} needs a column-parallel projection and "
                             "'qkv' or 'split'")

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.parts)

    def hf_weights(self) -> dict[str, tuple[int, int]]:
        return {f"{name}.weight": (n, self.in_features) for name, n in self.parts}

    def hf_biases(self) -> dict[str, tuple[int]]:
        return {f"{name}.bias": (n,) for name, n in self.parts} if self.bias else {}


@dataclass(frozen=True, slots=True)
class Weight:
    hf_name: str
    hf_shape: tuple[int, ...]
    leaf: str = "weight"                  # its name in the params tree ("embedding", "kernel", ...)
    transpose: bool = False               # params hold the transpose of the HF tensor (an untied LM head)
    split: str = REPLICATED               # REPLICATED, VOCAB_ROWS or VOCAB_COLUMNS (when the mesh divides V)
    float_only: bool = False              # refused when a checkpoint holds it quantized
    fill: float | None = None             # random weights hold this value (norms), else are drawn

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.hf_shape)) if self.transpose else self.hf_shape


EXPERTS = "experts"                       # an ExpertProjection's split: its leading expert axis


@dataclass(frozen=True, slots=True)
class ExpertProjection:
    """A mixture-of-experts layer's projection, stacked over its experts: expert e's HF weights
    ([out, in] each, names with "{e}" for the expert) fused along out as a Projection's are, the
    experts stacked first: params `kernel` [E, in, out] (models/moe.py reads it). Quantized, each
    expert's leaves are a Projection's, stacked the same way. Never biased; its split over a mesh
    is by expert (`EXPERTS`), the expert-parallel rules' to place."""

    parts: tuple[tuple[str, int], ...]    # (HF name with "{e}", without ".weight", output features)
    in_features: int
    num_experts: int
    quantize: bool = True
    split: str = EXPERTS
    bias: bool = False

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.parts)

    def expert_weights(self, e: int) -> dict[str, tuple[int, int]]:
        """Expert e's HF weight names and shapes, in fused order."""
        return {f"{name.format(e=e)}.weight": (n, self.in_features) for name, n in self.parts}

    def hf_weights(self) -> dict[str, tuple[int, int]]:
        return {name: shape for e in range(self.num_experts) for name, shape in self.expert_weights(e).items()}

    def hf_biases(self) -> dict[str, tuple[int]]:
        return {}


@dataclass(frozen=True)
class TensorLayout:
    modules: Mapping[Path, Projection | ExpertProjection | Weight]
    # HF tensors a checkpoint may carry that the model never reads (recomputed buffers; the tied
    # LM head some exporters write twice), dropped at load
    ignored_suffixes: tuple[str, ...] = ()
    tied_lm_head: str | None = None       # the HF name of a tied model's duplicate LM head

    def projections(self) -> Iterator[tuple[Path, Projection]]:
        for path, spec in self.modules.items():
            if isinstance(spec, Projection):
                yield path, spec

    def expert_projections(self) -> Iterator[tuple[Path, ExpertProjection]]:
        for path, spec in self.modules.items():
            if isinstance(spec, ExpertProjection):
                yield path, spec

    def weights(self) -> Iterator[tuple[Path, Weight]]:
        for path, spec in self.modules.items():
            if isinstance(spec, Weight):
                yield path, spec

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> HF shape ([out, in] for linear weights) of every tensor the model reads."""
        shapes: dict[str, tuple[int, ...]] = {}
        for spec in self.modules.values():
            if isinstance(spec, (Projection, ExpertProjection)):
                shapes |= spec.hf_weights() | spec.hf_biases()
            else:
                shapes[spec.hf_name] = spec.hf_shape
        return shapes

    def quantizable(self) -> dict[str, Path]:
        """HF weight name -> the params module that reads it, for every weight quantization may
        replace (the calibration records each module's input under its path)."""
        return {name: path for path, p in [*self.projections(), *self.expert_projections()] if p.quantize
                for name in p.hf_weights()}

    def spec_of(self, path: Path) -> Projection | ExpertProjection | Weight | None:
        """The declaration of the module holding the leaf at `path` (keys from the params root)."""
        return self.modules.get(tuple(path[:-1]))


def module_name(path: Path) -> str:
    return "/".join(path)
