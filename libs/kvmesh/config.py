"""Typed settings, one home for every knob. Each field can be set from a TOML file or the environment
(``KVMESH_<FIELD>``, e.g. ``KVMESH_BLOCK_SIZE=32``); explicit arguments win over both."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None          # HF directory or .gguf file; None = the embedded SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "fp32"               # compute dtype: fp32 | bf16 | fp16
    threads: int = 1                  # torch threads for this engine (0 = leave torch's default)
    attention: str = "auto"           # auto | torch | native (CPU C kernel) | flashinfer (CUDA)
    block_size: int = 16
    kv_cache_mb: int = 512            # device KV pool size (ignored when num_blocks > 0)
    num_blocks: int = 0
    kv_dtype: str = "fp32"            # fp32 | bf16 | fp16 | fp8 (storage; attention computes in `dtype`)
    host_cache_mb: int = 0            # L2 host tier (0 = off)
    eviction: str = "lru"             # lru | lfu | slru | priority
    enable_prefix_caching: bool = True
    max_batched_tokens: int = 1024    # token budget of one forward step (chunked prefill)
    max_num_seqs: int = 64            # running sequences at once
    max_model_len: int = 0            # 0 = the model's max_position_embeddings


def _coerce(value: str, typ: Any) -> Any:
    typ = str(typ)
    if "bool" in typ:
        return value.strip().lower() in ("1", "true", "yes", "on")
    if "int" in typ:
        return int(value)
    if "float" in typ:
        return float(value)
    return None if value == "" and "None" in typ else value


def load(cls: type[T], path: str | Path | None = None, env: dict[str, str] | None = None,
         section: str | None = None, defaults: dict[str, Any] | None = None, **overrides: Any) -> T:
    """Build ``cls`` from its field defaults < ``defaults`` < TOML file (optionally one ``[section]``) <
    environment < ``overrides`` (None values in ``overrides`` are ignored)."""
    values: dict[str, Any] = dict(defaults or {})
    if path is not None:
        data = tomllib.loads(Path(path).read_text())
        values.update(data.get(section, {}) if section else data)
    env = os.environ if env is None else env
    for f in fields(cls):  # type: ignore[arg-type]
        key = f"KVMESH_{f.name.upper()}"
        if key in env:
            values[f.name] = _coerce(env[key], f.type)
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(values) - {f.name for f in fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"unknown {cls.__name__} settings: {sorted(unknown)}")
    return cls(**values)


def replace(cfg: T, **changes: Any) -> T:
    return dataclasses.replace(cfg, **changes)  # type: ignore[type-var]
