"""Router settings (``KVMESH_<FIELD>`` env vars or the ``[router]`` TOML section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse

from kvmesh.routing import POLICIES
from kvmesh.settings.sections import key_problems as _key_problems
from kvmesh.settings.sections import parse_api_keys

__all__ = ["RouterConfig", "parse_api_keys"]


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
    disaggregate: str = "auto"           # always | never | auto (cost model: skip the hop when decode holds
                                         # most of the prompt); per request: header x-kvmesh-disaggregate
    slo_ttft_s: float = 0.0              # admission: reject (429) when no instance's estimated TTFT meets it; 0 = off
    prefill_tok_per_s: float = 240.0     # cost model: one instance's prefill speed (measured here: SmolLM2, 1 thread)
    api_key: str = ""                    # a key without a tenant (Bearer / x-api-key); "" = none
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant; env: "key1:tenantA,key2:tenantB"
    api_keys_file: str = ""              # more key:tenant pairs, one per line (e.g. a mounted secret)
    max_body_bytes: int = 4 * 2**20      # larger HTTP bodies / gRPC requests are refused (413)
    max_concurrent_requests: int = 256   # requests in flight at once; more are refused at once (429)
    max_requests_per_tenant: int = 0     # requests in flight per tenant (0 = only the global cap)

    def __post_init__(self) -> None:
        if isinstance(self.api_keys, str):  # from the environment
            object.__setattr__(self, "api_keys", parse_api_keys(self.api_keys, "api_keys"))
        problems = self.problems()
        if problems:
            raise ValueError("invalid router settings: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every setting that is out of range, each with what to set instead."""
        out = []
        if self.policy not in POLICIES:
            out.append(f"policy {self.policy!r} is unknown; choose one of {sorted(POLICIES)}")
        for name in ("grpc_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                out.append(f"{name} must be in [0, 65535] (0 = a free port), not {getattr(self, name)}")
        for name in ("instance_timeout_s", "kv_timeout_s", "match_timeout_s", "request_timeout_s",
                     "prefill_tok_per_s"):
            if not getattr(self, name) > 0:
                out.append(f"{name} must be > 0, not {getattr(self, name)}")
        if self.disaggregate not in ("auto", "always", "never"):
            out.append(f"disaggregate must be auto, always or never, not {self.disaggregate!r}")
        if not self.slo_ttft_s >= 0:
            out.append(f"slo_ttft_s must be >= 0 (0 = no admission control), not {self.slo_ttft_s}")
        for name in ("block_size", "max_body_bytes", "max_concurrent_requests"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.max_requests_per_tenant < 0:
            out.append(f"max_requests_per_tenant must be >= 0 (0 = off), not {self.max_requests_per_tenant}")
        if urlparse(self.nats_url).scheme not in ("nats", "tls", "ws", "wss"):
            out.append(f"nats_url must look like nats://host:port, not {self.nats_url!r}")
        if self.cachesvc_address and ":" not in self.cachesvc_address:
            out.append(f"cachesvc_address must be host:port (or \"\" for none), "
                       f"not {self.cachesvc_address!r}")
        if not isinstance(self.api_keys, dict):
            out.append("api_keys must be a table of key = tenant (or \"key:tenant,...\" in the environment)")
        else:
            for key, tenant in self.api_keys.items():
                out += _key_problems(key, tenant, "api_keys")
        return out
