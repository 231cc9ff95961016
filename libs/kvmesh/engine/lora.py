"""LoRA adapters in PEFT format, applied next to the fused base matmuls, grouped per adapter within a batch.

An adapter is a directory with ``adapter_config.json`` and ``adapter_model.safetensors`` (what PEFT's
``save_pretrained`` writes). Its target modules may be any of q/k/v/o_proj and gate/up/down_proj. The engine's
projections are fused (q|k|v, gate|up), so per layer and fused site the adapter is kept as one low-rank pair:
``A`` ``[sum r, in]`` (the modules' ``lora_A`` stacked) and ``B`` ``[out, sum r]`` (each module's
``scale * lora_B`` in its own block of rows and columns; zeros elsewhere), and

    y = base(x) + (x @ A^T) @ B^T

for the rows of that adapter only; the base model's rows skip it. The engine sorts a step's rows by adapter, so
each group is one contiguous slice (``LoRABatch``).

Identity: ``LoRASpec.lora_id`` is ``name@generation``, where the generation is a digest of the adapter's config
and weights. It enters the block-key namespace, so a reload of a name with other weights gets new keys on every
instance (and a restarted instance that loads the same files gets the same keys), independent of the order
adapters were registered in.

Residency: every registered adapter's tensors stay in host memory; at most ``max_loras`` are resident (fused, on
the engine's device) at once, least recently used swapped out. The scheduler runs at most ``max_loras`` distinct
adapters per step.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from kvmesh.model_source.hf_config import ModelConfig

# PEFT module name -> (fused site, position inside it)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of every projection LoRA may target."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


@dataclass
class LoRASpec:
    """A registered adapter: its identity and its tensors in host memory (float32, PEFT names parsed)."""

    name: str
    path: str
    generation: str
    rank: int                                              # the largest rank among its modules
    modules: tuple[str, ...]                               # target modules present
    # (layer, module) -> (A [r, in], B [out, r] with the module's scale folded in)
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False, default_factory=dict)

    @property
    def lora_id(self) -> str:
        return f"{self.name}@{self.generation}"


def _fail(name: str, path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r} at {path!r}: {what}")


def read_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoRASpec:
    """Read and validate a PEFT adapter directory against the base model; ValueError naming what to fix."""
    from safetensors.torch import load_file

    root = Path(path)
    if not name or "@" in name or name.strip() != name:
        raise ValueError(f"LoRA adapter name {name!r} is invalid: use a non-empty name without '@' or "
                         f"surrounding spaces")
    conf_path, weights_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not root.is_dir():
        raise _fail(name, path, "is not a readable directory; pass the folder PEFT's save_pretrained wrote")
    try:
        conf_bytes = conf_path.read_bytes()
        conf = json.loads(conf_bytes)
    except OSError as e:
        raise _fail(name, path, f"cannot read adapter_config.json ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise _fail(name, path, f"adapter_config.json is not valid JSON ({e})") from None
    try:
        weights_bytes = weights_path.read_bytes()
        raw = load_file(str(weights_path))
    except OSError as e:
        raise _fail(name, path, f"cannot read adapter_model.safetensors ({e.strerror or e}); only the "
                                f"safetensors format is served") from None
    except Exception as e:  # a corrupt file
        raise _fail(name, path, f"adapter_model.safetensors is unreadable ({type(e).__name__}: {e})") from e
    if conf.get("peft_type", "LORA") != "LORA":
        raise _fail(name, path, f"peft_type is {conf.get('peft_type')!r}; only LORA adapters are served")
    for key, ok, what in (("use_dora", lambda v: not v, "DoRA is not supported"),
                          ("bias", lambda v: v in (None, "none"), ("trained biases (bias != 'none') are not "
                                                                 "supported")),
                          ("lora_bias", lambda v: not v, "LoRA biases (lora_bias) are not supported"),
                          ("modules_to_save", lambda v: not v, ("modules_to_save (full extra weights) are not "
                                                               "supported")),
                          ("fan_in_fan_out", lambda v: not v, ("fan_in_fan_out (Conv1D layouts) is not "
                                                              "supported"))):
        if not ok(conf.get(key)):
            raise _fail(name, path, f"{what}; retrain without {key}")
    alpha = float(conf.get("lora_alpha", conf.get("r", 8)))
    alpha_pattern = conf.get("alpha_pattern") or {}
    rslora = bool(conf.get("use_rslora"))
    shapes = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY.search(key)
        if m is None:
            raise _fail(name, path, f"tensor {key!r} is not a LoRA weight of a q/k/v/o/gate/up/down projection")
        layer, prefix, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in MODULES or _PREFIX[module] != prefix:
            raise _fail(name, path, f"target module {prefix}.{module} is not supported; target some of "
                                    f"{sorted(MODULES)}")
        if layer >= cfg.num_layers:
            raise _fail(name, path, f"tensor {key!r} is for layer {layer} but the base model has "
                                    f"{cfg.num_layers} layers: the adapter was trained for another model")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise _fail(name, path, "adapter_model.safetensors holds no LoRA weights")
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _fail(name, path, f"layer {layer} {module} has lora_{''.join(ab)} but not both lora_A and "
                                    f"lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        fan_in, fan_out = shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise _fail(name, path, f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} "
                                    f"do not fit the base model's {module} (in {fan_in}, out {fan_out}); expected "
                                    f"lora_A (r, {fan_in}) and lora_B ({fan_out}, r): the adapter was trained "
                                    f"for another model")
        if r > max_rank:
            raise _fail(name, path, f"rank {r} (layer {layer} {module}) exceeds max_lora_rank {max_rank}; raise "
                                    f"max_lora_rank or serve a lower-rank adapter")
        full = f"model.layers.{layer}.{_PREFIX[module]}.{module}"  # PEFT matches patterns on the name's end
        a_mod = next((float(v) for k, v in alpha_pattern.items() if re.match(rf"(.*\.)?{k}$", full)), alpha)
        scale = a_mod / (r ** 0.5 if rslora else r)
        tensors[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
        rank = max(rank, r)
    digest = xxhash.xxh3_64(conf_bytes)
    digest.update(weights_bytes)
    return LoRASpec(name, str(root), digest.hexdigest(), rank,
                    tuple(sorted({m for _, m in tensors}, key=list(MODULES).index)), tensors)


class LoRAWeights:
    """One adapter made resident: per layer and fused site, ``(A [R, in], B [out, R])`` on the device."""

    def __init__(self, spec: LoRASpec, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        self.spec = spec
        shapes = module_shapes(cfg)
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for layer in range(cfg.num_layers):
            sites: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for site in ("qkv", "o", "gate_up", "down"):
                members = [m for m, (s, _) in MODULES.items() if s == site]
                present = [m for m in members if (layer, m) in spec.tensors]
                if not present:
                    continue
                out_total = sum(shapes[m][1] for m in members)
                r_total = sum(spec.tensors[(layer, m)][0].shape[0] for m in present)
                a = torch.cat([spec.tensors[(layer, m)][0] for m in present])
                b = torch.zeros(out_total, r_total)
                row, col = 0, 0
                for m in members:
                    width = shapes[m][1]
                    if m in present:
                        bm = spec.tensors[(layer, m)][1]
                        b[row:row + width, col:col + bm.shape[1]] = bm
                        col += bm.shape[1]
                    row += width
                sites[site] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
            self.layers.append(sites)


@dataclass
class LoRABatch:
    """The adapter groups of one forward step: ``(weights, slice of rows)``, the base model's rows absent."""

    groups: list[tuple[LoRAWeights, slice]]

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> None:
        """``y[rows] += (x[rows] @ A^T) @ B^T`` for each adapter group that targets ``site`` in ``layer``."""
        for w, rows in self.groups:
            ab = w.layers[layer].get(site)
            if ab is not None:
                a, b = ab
                y[rows].addmm_(x[rows] @ a.t(), b.t())  # in place on the group's rows: no extra copy


class LoRAManager:
    """The registered adapters (host memory) and the LRU set of at most ``max_loras`` resident ones."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.cfg, self.max_loras, self.max_rank, self.dtype, self.device = cfg, max_loras, max_rank, dtype, device
        self.registered: dict[str, LoRASpec] = {}
        self.resident: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.swaps = 0  # adapters made resident (first use or swapped back in)

    def load(self, name: str, path: str) -> LoRASpec:
        """Register (or replace) ``name``; validation errors leave the previous registration untouched."""
        return self.register(read_adapter(name, path, self.cfg, self.max_rank))

    def read(self, name: str, path: str) -> LoRASpec:
        """``read_adapter`` against this engine's model and max rank (thread-safe: touches no state)."""
        return read_adapter(name, path, self.cfg, self.max_rank)

    def register(self, spec: LoRASpec) -> LoRASpec:
        self.registered[spec.name] = spec
        self.resident.pop(spec.name, None)  # other weights under the name: made resident afresh on next use
        return spec

    def unload(self, name: str) -> LoRASpec:
        if name not in self.registered:
            raise KeyError(name)
        self.resident.pop(name, None)
        return self.registered.pop(name)

    def get(self, name: str) -> LoRASpec:
        return self.registered[name]

    def weights(self, spec: LoRASpec) -> LoRAWeights:
        """The resident weights of ``spec`` (made resident, evicting the least recently used, if needed)."""
        w = self.resident.get(spec.name)
        if w is not None and w.spec is spec:
            self.resident.move_to_end(spec.name)
            return w
        while len(self.resident) >= self.max_loras:
            self.resident.popitem(last=False)
        w = LoRAWeights(spec, self.cfg, self.dtype, self.device)
        self.resident[spec.name] = w
        self.swaps += 1
        return w

    def listing(self) -> list[tuple[str, str]]:
        """``(name, generation)`` of every registered adapter, by name."""
        return sorted((s.name, s.generation) for s in self.registered.values())
