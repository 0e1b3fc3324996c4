"""The handshake: a decode engine loads a prefill engine's blocks only if every property that gives
the bytes their meaning matches: block size, KV element type, layers, KV heads, head size, and the
checkpoint (same weights, same quantized-KV scales). A mismatch is a clear error naming each
difference, never a silent wrong answer."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.runner.kv_transfer import BlockLayout
from jaxserve.disagg.proto import kv_transfer_pb2 as kv_pb


class KVLayoutMismatch(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class KVLayout:
    block: BlockLayout
    checkpoint_identity: str
    role: str = "both"

    def to_proto(self) -> kv_pb.KVLayout:
        b = self.block
        return kv_pb.KVLayout(block_size=b.block_size, kv_dtype=b.dtype, num_layers=b.num_layers,
                              num_kv_heads=b.num_kv_heads, head_dim=b.head_dim,
                              checkpoint_identity=self.checkpoint_identity, role=self.role)

    @classmethod
    def from_proto(cls, m: kv_pb.KVLayout) -> "KVLayout":
        return cls(BlockLayout(m.num_layers, m.block_size, m.num_kv_heads, m.head_dim, m.kv_dtype),
                   m.checkpoint_identity, m.role)


_FIELDS = (("block size", lambda l: l.block.block_size), ("KV dtype", lambda l: l.block.dtype),
           ("layers", lambda l: l.block.num_layers), ("KV heads", lambda l: l.block.num_kv_heads),
           ("head size", lambda l: l.block.head_dim), ("checkpoint", lambda l: l.checkpoint_identity))


def check_compatible(local: KVLayout, remote: KVLayout, peer: str) -> None:
    """Raise KVLayoutMismatch naming every property in which `remote` (the engine at `peer`)
    differs from `local`."""
    diffs = [f"{name} {get(remote)!r} there, {get(local)!r} here" for name, get in _FIELDS if get(remote) != get(local)]
    if diffs:
        raise KVLayoutMismatch(f"the KV of {peer} cannot be loaded here: " + "; ".join(diffs))
