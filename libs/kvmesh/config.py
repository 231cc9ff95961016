"""Typed settings, one home for every knob. Each field can be set from a TOML file or the environment
(``KVMESH_<FIELD>``, e.g. ``KVMESH_BLOCK_SIZE=32``); explicit arguments win over both."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from kvmesh.settings.sections import ATTENTION, COMPUTE_DTYPES, KV_DTYPES
from kvmesh.settings.sections import ENGINE_ZERO_MEANS as ZERO_MEANS

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
    eviction: str = "lru"             # lru | lfu | slru | priority | the others in kvmesh.engine.eviction
    enable_prefix_caching: bool = True
    max_batched_tokens: int = 1024    # token budget of one forward step (chunked prefill)
    max_num_seqs: int = 64            # running sequences at once
    max_model_len: int = 0            # 0 = the model's max_position_embeddings
    lora_adapters: str = ""           # LoRA adapters loaded at start: "NAME=PATH,NAME=PATH" (PEFT directories)
    max_loras: int = 4                # adapters resident (and distinct in one step) at once; LRU swapped
    max_lora_rank: int = 64           # adapters of a higher rank are refused at load time

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("invalid engine settings: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every setting that is out of range, each with what to set instead."""
        from kvmesh.engine.eviction import make_policy

        out = []
        try:
            make_policy(self.eviction)  # an unknown name, or one that needs the future (belady)
        except ValueError as e:
            out.append(str(e))
        choices = {"dtype": COMPUTE_DTYPES, "kv_dtype": KV_DTYPES, "attention": ATTENTION}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                out.append(f"{name} {getattr(self, name)!r} is unknown; choose one of {sorted(allowed)}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            out.append(f"device must be cpu, cuda or cuda:<index>, not {self.device!r}")
        for name in ("block_size", "max_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in ("threads", "num_blocks", "host_cache_mb", "max_model_len"):
            if getattr(self, name) < 0:
                out.append(f"{name} must be >= 0 (0 = {ZERO_MEANS[name]}), not {getattr(self, name)}")
        if self.num_blocks == 0 and self.kv_cache_mb < 1:
            out.append(f"kv_cache_mb must be >= 1 (or set num_blocks), not {self.kv_cache_mb}")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, not {getattr(self, name)}")
        try:
            self.lora_adapter_paths()
        except ValueError as e:
            out.append(str(e))
        return out

    def lora_adapter_paths(self) -> list[tuple[str, str]]:
        """``lora_adapters`` parsed: ``[(name, path)]``; ValueError naming the entry that is not NAME=PATH."""
        out = []
        for entry in filter(None, (e.strip() for e in self.lora_adapters.split(","))):
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_adapters entry {entry!r} is not NAME=PATH")
            out.append((name.strip(), path.strip()))
        return out


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def coerce(key: str, value: str, typ: Any) -> Any:
    """``value``, text from the environment variable (or flag) ``key``, as the field type ``typ``; a
    ValueError that names ``key`` and what it expects otherwise."""
    typ, text = str(typ), value.strip().lower()
    if "bool" in typ:
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError(f"{key}={value!r}: expected a boolean (true/false, 1/0, yes/no, on/off)")
    try:
        if "int" in typ:
            return int(text)
        if "float" in typ:
            return float(text)
    except ValueError:
        what = "an integer" if "int" in typ else "a number"
        raise ValueError(f"{key}={value!r}: expected {what}") from None
    return None if value == "" and "None" in typ else value


def _check_file_value(where: str, name: str, value: Any, typ: Any) -> Any:
    """A TOML value of the field's type (an int is a fine float), else a ValueError that says where it is."""
    typ = str(typ)
    if "bool" in typ:
        ok, what = isinstance(value, bool), "a boolean"
    elif "int" in typ:
        ok, what = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif "float" in typ:
        ok, what = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        value = float(value) if ok else value
    elif typ.startswith("str"):
        ok, what = isinstance(value, str), "a string"
    else:  # e.g. a table; the class checks it
        ok, what = True, ""
    if not ok:
        raise ValueError(f"{where}: {name} = {value!r}: expected {what}")
    return value


def load(cls: type[T], path: str | Path | None = None, env: dict[str, str] | None = None,
         section: str | None = None, defaults: dict[str, Any] | None = None, **overrides: Any) -> T:
    """Build ``cls`` from its field defaults < ``defaults`` < TOML file (optionally one ``[section]``) <
    environment < ``overrides`` (None values in ``overrides`` are ignored)."""
    values: dict[str, Any] = dict(defaults or {})
    types = {f.name: f.type for f in fields(cls)}  # type: ignore[arg-type]
    if path is not None:
        where = f"{path}" + (f" [{section}]" if section else "")
        data = tomllib.loads(Path(path).read_text())
        table = data.get(section, {}) if section else data
        unknown = sorted(set(table) - set(types))
        if unknown:
            raise ValueError(f"{where}: unknown settings {unknown}; {cls.__name__} has {sorted(types)}")
        values.update({k: _check_file_value(where, k, v, types[k]) for k, v in table.items()})
    env = os.environ if env is None else env
    for name, typ in types.items():
        key = f"KVMESH_{name.upper()}"
        if key in env and (env[key] != "" or "str" in str(typ)):  # an empty number or flag means unset
            values[name] = coerce(key, env[key], typ)
    values.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} settings: {unknown}")
    return cls(**values)


def replace(cfg: T, **changes: Any) -> T:
    return dataclasses.replace(cfg, **changes)  # type: ignore[type-var]
