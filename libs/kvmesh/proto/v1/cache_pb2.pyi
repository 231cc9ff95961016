from kvmesh.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardView(_message.Message):
    __slots__ = ("shard", "shards", "index_copies", "pool_copies")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_COPIES_FIELD_NUMBER: _ClassVar[int]
    POOL_COPIES_FIELD_NUMBER: _ClassVar[int]
    shard: int
    shards: int
    index_copies: int
    pool_copies: int
    def __init__(self, shard: _Optional[int] = ..., shards: _Optional[int] = ..., index_copies: _Optional[int] = ..., pool_copies: _Optional[int] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("block_keys", "view", "packed", "holders_epoch", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    view: ShardView
    packed: bool
    holders_epoch: int
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, block_keys: _Optional[_Iterable[int]] = ..., view: _Optional[_Union[ShardView, _Mapping]] = ..., packed: _Optional[bool] = ..., holders_epoch: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class MatchPrefixBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[MatchPrefixRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[MatchPrefixRequest, _Mapping]]] = ...) -> None: ...

class MatchPrefixBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[MatchPrefixResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[MatchPrefixResponse, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("matches", "index_copies", "pool_held", "packed", "holder_ids", "holder_counts", "holders_epoch", "holders")
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    INDEX_COPIES_FIELD_NUMBER: _ClassVar[int]
    POOL_HELD_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_IDS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_COUNTS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[TierMatch]
    index_copies: int
    pool_held: _containers.RepeatedCompositeFieldContainer[PoolHeld]
    packed: bool
    holder_ids: bytes
    holder_counts: bytes
    holders_epoch: int
    holders: _containers.RepeatedCompositeFieldContainer[HolderName]
    def __init__(self, matches: _Optional[_Iterable[_Union[TierMatch, _Mapping]]] = ..., index_copies: _Optional[int] = ..., pool_held: _Optional[_Iterable[_Union[PoolHeld, _Mapping]]] = ..., packed: _Optional[bool] = ..., holder_ids: _Optional[bytes] = ..., holder_counts: _Optional[bytes] = ..., holders_epoch: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[HolderName, _Mapping]]] = ...) -> None: ...

class HolderName(_message.Message):
    __slots__ = ("id", "instance_id", "tier")
    ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    id: int
    instance_id: str
    tier: str
    def __init__(self, id: _Optional[int] = ..., instance_id: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class PoolHeld(_message.Message):
    __slots__ = ("tier", "positions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    positions: bytes
    def __init__(self, tier: _Optional[str] = ..., positions: _Optional[bytes] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("layout", "block_keys", "checksums", "data", "priority", "priority_duration_s", "transfer_id", "session_key", "session_end", "session_blocks", "view")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_END_FIELD_NUMBER: _ClassVar[int]
    SESSION_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.BlockLayout
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    priority: int
    priority_duration_s: float
    transfer_id: str
    session_key: str
    session_end: bool
    session_blocks: _containers.RepeatedScalarFieldContainer[int]
    view: ShardView
    def __init__(self, layout: _Optional[_Union[_common_pb2.BlockLayout, _Mapping]] = ..., block_keys: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., priority: _Optional[int] = ..., priority_duration_s: _Optional[float] = ..., transfer_id: _Optional[str] = ..., session_key: _Optional[str] = ..., session_end: _Optional[bool] = ..., session_blocks: _Optional[_Iterable[int]] = ..., view: _Optional[_Union[ShardView, _Mapping]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("stored", "skipped")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    skipped: int
    def __init__(self, stored: _Optional[int] = ..., skipped: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("layout", "block_keys", "lease_s", "transfer_address", "transfer_id", "transfer_token", "transfer_versions", "copy", "view")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.BlockLayout
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    transfer_address: str
    transfer_id: str
    transfer_token: str
    transfer_versions: str
    copy: bool
    view: ShardView
    def __init__(self, layout: _Optional[_Union[_common_pb2.BlockLayout, _Mapping]] = ..., block_keys: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., transfer_address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., transfer_token: _Optional[str] = ..., transfer_versions: _Optional[str] = ..., copy: _Optional[bool] = ..., view: _Optional[_Union[ShardView, _Mapping]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("block_keys", "checksums", "data", "tiers", "lease_id", "leased_blocks", "priorities", "priority_s", "sessions")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_S_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    tiers: _containers.RepeatedScalarFieldContainer[str]
    lease_id: int
    leased_blocks: int
    priorities: _containers.RepeatedScalarFieldContainer[int]
    priority_s: _containers.RepeatedScalarFieldContainer[float]
    sessions: _containers.RepeatedCompositeFieldContainer[BlockSessions]
    def __init__(self, block_keys: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., tiers: _Optional[_Iterable[str]] = ..., lease_id: _Optional[int] = ..., leased_blocks: _Optional[int] = ..., priorities: _Optional[_Iterable[int]] = ..., priority_s: _Optional[_Iterable[float]] = ..., sessions: _Optional[_Iterable[_Union[BlockSessions, _Mapping]]] = ...) -> None: ...

class BlockSessions(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class LeaseBlocksRequest(_message.Message):
    __slots__ = ("block_keys", "lease_s", "view")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    view: ShardView
    def __init__(self, block_keys: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., view: _Optional[_Union[ShardView, _Mapping]] = ...) -> None: ...

class LeaseBlocksResponse(_message.Message):
    __slots__ = ("lease_id", "num_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    num_blocks: int
    def __init__(self, lease_id: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("indexed_blocks", "instances", "pool_blocks", "pool_bytes", "pool_capacity_bytes", "events_applied", "event_gaps", "tiers", "leases", "leased_blocks", "snapshots_requested", "snapshots_applied", "caught_up", "transfer_address", "view", "repaired_blocks", "repaired_bytes", "repair_pending_slots", "handover_pending_shards")
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    EVENT_GAPS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPAIR_PENDING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_PENDING_SHARDS_FIELD_NUMBER: _ClassVar[int]
    indexed_blocks: int
    instances: int
    pool_blocks: int
    pool_bytes: int
    pool_capacity_bytes: int
    events_applied: int
    event_gaps: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    leases: int
    leased_blocks: int
    snapshots_requested: int
    snapshots_applied: int
    caught_up: bool
    transfer_address: str
    view: ShardView
    repaired_blocks: int
    repaired_bytes: int
    repair_pending_slots: int
    handover_pending_shards: int
    def __init__(self, indexed_blocks: _Optional[int] = ..., instances: _Optional[int] = ..., pool_blocks: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., pool_capacity_bytes: _Optional[int] = ..., events_applied: _Optional[int] = ..., event_gaps: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., leases: _Optional[int] = ..., leased_blocks: _Optional[int] = ..., snapshots_requested: _Optional[int] = ..., snapshots_applied: _Optional[int] = ..., caught_up: _Optional[bool] = ..., transfer_address: _Optional[str] = ..., view: _Optional[_Union[ShardView, _Mapping]] = ..., repaired_blocks: _Optional[int] = ..., repaired_bytes: _Optional[int] = ..., repair_pending_slots: _Optional[int] = ..., handover_pending_shards: _Optional[int] = ...) -> None: ...

class ListBlocksRequest(_message.Message):
    __slots__ = ("slots", "foreign_only", "view")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    FOREIGN_ONLY_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    slots: bytes
    foreign_only: bool
    view: ShardView
    def __init__(self, slots: _Optional[bytes] = ..., foreign_only: _Optional[bool] = ..., view: _Optional[_Union[ShardView, _Mapping]] = ...) -> None: ...

class ListBlocksResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[LayoutBlocks]
    def __init__(self, blocks: _Optional[_Iterable[_Union[LayoutBlocks, _Mapping]]] = ...) -> None: ...

class LayoutBlocks(_message.Message):
    __slots__ = ("layout", "block_keys")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.BlockLayout
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[_Union[_common_pb2.BlockLayout, _Mapping]] = ..., block_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class GrantPutRequest(_message.Message):
    __slots__ = ("num_blocks", "view")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    view: ShardView
    def __init__(self, num_blocks: _Optional[int] = ..., view: _Optional[_Union[ShardView, _Mapping]] = ...) -> None: ...

class GrantPutResponse(_message.Message):
    __slots__ = ("transfer_address", "transfer_id", "token", "expires_in_s", "transfer_versions")
    TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    transfer_address: str
    transfer_id: str
    token: str
    expires_in_s: float
    transfer_versions: str
    def __init__(self, transfer_address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., token: _Optional[str] = ..., expires_in_s: _Optional[float] = ..., transfer_versions: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "blocks", "bytes", "capacity_bytes", "evicted")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    blocks: int
    bytes: int
    capacity_bytes: int
    evicted: int
    def __init__(self, tier: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...
