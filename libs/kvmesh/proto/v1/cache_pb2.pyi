from kvmesh.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MatchPrefixRequest(_message.Message):
    __slots__ = ("block_keys",)
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class TierMatch(_message.Message):
    __slots__ = ("instance_id", "tier", "num_blocks")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    tier: str
    num_blocks: int
    def __init__(self, instance_id: _Optional[str] = ..., tier: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[TierMatch]
    def __init__(self, matches: _Optional[_Iterable[_Union[TierMatch, _Mapping]]] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("layout", "block_keys", "checksums", "data")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.BlockLayout
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, layout: _Optional[_Union[_common_pb2.BlockLayout, _Mapping]] = ..., block_keys: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("stored", "skipped")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    skipped: int
    def __init__(self, stored: _Optional[int] = ..., skipped: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("layout", "block_keys")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.BlockLayout
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[_Union[_common_pb2.BlockLayout, _Mapping]] = ..., block_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("block_keys", "checksums", "data")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, block_keys: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("indexed_blocks", "instances", "pool_blocks", "pool_bytes", "pool_capacity_bytes", "events_applied", "event_gaps")
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    EVENT_GAPS_FIELD_NUMBER: _ClassVar[int]
    indexed_blocks: int
    instances: int
    pool_blocks: int
    pool_bytes: int
    pool_capacity_bytes: int
    events_applied: int
    event_gaps: int
    def __init__(self, indexed_blocks: _Optional[int] = ..., instances: _Optional[int] = ..., pool_blocks: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., pool_capacity_bytes: _Optional[int] = ..., events_applied: _Optional[int] = ..., event_gaps: _Optional[int] = ...) -> None: ...
