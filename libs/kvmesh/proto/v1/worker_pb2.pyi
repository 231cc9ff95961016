from kvmesh.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt_packed", "sampling", "cache_salt", "pool_blocks", "lora_name", "session_key", "session_end", "retention", "generated_tokens", "slo", "waited_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PACKED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_END_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_packed: bytes
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    pool_blocks: int
    lora_name: str
    session_key: str
    session_end: bool
    retention: _containers.RepeatedCompositeFieldContainer[_common_pb2.Retention]
    generated_tokens: int
    slo: _common_pb2.SLO
    waited_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_packed: _Optional[bytes] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., pool_blocks: _Optional[int] = ..., lora_name: _Optional[str] = ..., session_key: _Optional[str] = ..., session_end: _Optional[bool] = ..., retention: _Optional[_Iterable[_Union[_common_pb2.Retention, _Mapping]]] = ..., generated_tokens: _Optional[int] = ..., slo: _Optional[_Union[_common_pb2.SLO, _Mapping]] = ..., waited_s: _Optional[float] = ...) -> None: ...

class LoadLoRARequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoRARequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class ListLoRARequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "generation", "path", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    generation: str
    path: str
    rank: int
    def __init__(self, name: _Optional[str] = ..., generation: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class LoRAAdapters(_message.Message):
    __slots__ = ("adapters", "ts")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoRAAdapter]
    ts: float
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoRAAdapter, _Mapping]]] = ..., ts: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("work", "decode_instance", "decode_transfer_address", "decode_cached_blocks", "push_token", "push_versions")
    WORK_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PUSH_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    work: WorkRequest
    decode_instance: str
    decode_transfer_address: str
    decode_cached_blocks: int
    push_token: str
    push_versions: str
    def __init__(self, work: _Optional[_Union[WorkRequest, _Mapping]] = ..., decode_instance: _Optional[str] = ..., decode_transfer_address: _Optional[str] = ..., decode_cached_blocks: _Optional[int] = ..., push_token: _Optional[str] = ..., push_versions: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "cached_tokens", "num_blocks", "transfer_bytes", "transfer_s", "transfer_id", "compute_s", "first_logprobs", "pool_fetch")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOL_FETCH_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    cached_tokens: int
    num_blocks: int
    transfer_bytes: int
    transfer_s: float
    transfer_id: str
    compute_s: float
    first_logprobs: _common_pb2.TokenLogprobs
    pool_fetch: str
    def __init__(self, first_token: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., transfer_id: _Optional[str] = ..., compute_s: _Optional[float] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., pool_fetch: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("work", "prefill_locally", "kv_timeout_s", "cached_blocks", "route_reason", "expected_prefill_s")
    WORK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    work: WorkRequest
    prefill_locally: bool
    kv_timeout_s: float
    cached_blocks: int
    route_reason: str
    expected_prefill_s: float
    def __init__(self, work: _Optional[_Union[WorkRequest, _Mapping]] = ..., prefill_locally: _Optional[bool] = ..., kv_timeout_s: _Optional[float] = ..., cached_blocks: _Optional[int] = ..., route_reason: _Optional[str] = ..., expected_prefill_s: _Optional[float] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finished", "finish_reason", "cached_tokens", "kv_fallback", "fallback_reason", "logprobs", "pool_fetch", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POOL_FETCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    cached_tokens: int
    kv_fallback: bool
    fallback_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    pool_fetch: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., kv_fallback: _Optional[bool] = ..., fallback_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., pool_fetch: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...
