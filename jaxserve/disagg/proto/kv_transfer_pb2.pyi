from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetKVLayoutRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("block_size", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "checkpoint_identity", "role")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    checkpoint_identity: str
    role: str
    def __init__(self, block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., checkpoint_identity: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("transfer_id", "generation", "first_block", "num_blocks", "num_tokens", "tokens_sha256")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SHA256_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    generation: int
    first_block: int
    num_blocks: int
    num_tokens: int
    tokens_sha256: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., generation: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., tokens_sha256: _Optional[bytes] = ...) -> None: ...

class KVBlocks(_message.Message):
    __slots__ = ("generation", "first_block", "num_blocks", "data")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    generation: int
    first_block: int
    num_blocks: int
    data: bytes
    def __init__(self, generation: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVLeaseRequest(_message.Message):
    __slots__ = ("transfer_id", "generation", "release")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    generation: int
    release: bool
    def __init__(self, transfer_id: _Optional[str] = ..., generation: _Optional[int] = ..., release: _Optional[bool] = ...) -> None: ...

class KVLeaseReply(_message.Message):
    __slots__ = ("live",)
    LIVE_FIELD_NUMBER: _ClassVar[int]
    live: bool
    def __init__(self, live: _Optional[bool] = ...) -> None: ...
