"""Router settings (``KVMESH_<FIELD>`` env vars or the ``[router]`` TOML section)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    model: str | None = None             # same model source as the engines (tokenizer + fingerprint)
    model_name: str = ""                 # id served in /v1/models (default: the model's file or folder name)
    cluster: str = "local"
    nats_url: str = "nats://127.0.0.1:4222"
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    cachesvc_address: str = "127.0.0.1:50060"  # "" = no cache service: route by load only
    block_size: int = 16                 # must equal the engines' (instances with another are ignored)
    instance_timeout_s: float = 3.0      # an instance that has not beaten for this long is dropped
    kv_timeout_s: float = 10.0           # passed to decode: wait for kv.ready this long, then recompute
    match_timeout_s: float = 0.5         # MatchPrefix deadline; past it, route by load alone
    request_timeout_s: float = 600.0     # deadline of the Prefill and Decode calls of one request
    policy: str = "cache_aware"          # round_robin | random | least_loaded | cache_aware (per request:
                                         # HTTP header / gRPC metadata x-kvmesh-policy)
    slo_ttft_s: float = 0.0              # admission: reject (429) when no instance's estimated TTFT meets it; 0 = off
    prefill_tok_per_s: float = 240.0     # cost model: one instance's prefill speed (measured here: SmolLM2, 1 thread)
    api_key: str = ""                    # when set, requests must carry it (Bearer / x-api-key / gRPC metadata)
