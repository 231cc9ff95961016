"""kvmesh's KV connector for vLLM (``KVConnectorBase_V1``, loaded by module path): the pool for vLLM instances.

vLLM asks a connector, per request, how many prompt tokens past its own prefix cache can come from outside; loads
them into the blocks it allocated; and tells it when a request finishes, before its blocks are freed. This one:

- **Loads pool hits.** Before a request runs, the instance host fetches from cachesvc the blocks the pool holds
  past what vLLM caches, verified, and stages them (``Bridge.stage``, through ``Engine.adopt``). When vLLM admits
  the request, every whole vLLM block of its prompt (past its local hit, short of the last token) whose kvmesh
  blocks are all staged counts as an external hit; the worker side writes them into vLLM's paged KV, converted
  from the wire layout (``layout.PagedLayout``), before the forward pass (a synchronous load: the bytes are in
  memory).
- **Writes finished blocks back.** A request that asked for it (``kvmesh_export``) has its computed full blocks
  read out of vLLM's paged KV at ``request_finished`` (before vLLM frees them), converted to the wire layout, and
  handed to its engine output (``Bridge.exports``), which the decode service writes to the pool.
- **Pushes a prefill's KV while it computes** (PD, ``kvmesh_plan``: the request's ``ExportPlan``). Each step's
  metadata names, per such request, the kvmesh blocks the step completes (the last chunk: its partial block too)
  and its vLLM blocks; in the forward pass, ``save_kv_layer`` reads each layer group's slice of them as soon as
  that group's last layer has written its KV and hands it to the engine (``Bridge.emit``), which streams it to
  the prefill service: the push of the early layers travels while the later ones compute.
- **Takes a pushed prompt** (PD decode, ``kvmesh_import``): the verified parts (``Bridge.imports``) are counted as
  external tokens past vLLM's local hit up to the prompt's last token (which vLLM computes, and samples the first
  token from, as in vLLM's own PD), and written into the blocks vLLM allocated before the forward pass. A push
  that starts past vLLM's local hit (its prefix was evicted meanwhile) is not usable: vLLM computes the prompt.

vLLM runs in the instance's own process, so both halves of the connector (vLLM makes a scheduler-side and a
worker-side instance) reach their engine's ``Bridge`` through ``BRIDGES`` by the id in
``kv_connector_extra_config``; the per-step metadata vLLM passes from one half to the other names what to load.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvmesh.contracts.engine import ExportedKV, layer_bounds
from kvmesh.contracts.ids import BlockKey, NamespaceSeed
from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.layout import KVLayout
from kvmesh.vllm.layout import TORCH_DTYPES, LayerCache, PagedLayout, Unconvertible
from kvmesh.vllm.mover import Mover

log = logging.getLogger(__name__)
BRIDGES: dict[str, Bridge] = {}
_LAYER = re.compile(r"\blayers\.(\d+)\.")


class Bridge:
    """What an engine shares with its connector: blocks staged from the pool, the paged KV once vLLM registered
    it, and the read-outs of finished requests. ``namespace(salt, vllm adapter name)``: a request's seed."""

    def __init__(self, wire: KVLayout, vllm_block_size: int, namespace: Callable[[str, str], NamespaceSeed],
                 capacity_blocks: int) -> None:
        self.wire, self.vllm_block_size = wire, vllm_block_size
        self.per = vllm_block_size // wire.block_size
        self.namespace = namespace
        self.capacity = capacity_blocks
        self.staged: OrderedDict[BlockKey, memoryview] = OrderedDict()  # kvmesh block -> its wire bytes
        self.paged: PagedLayout | None = None
        self.mover: Mover | None = None
        self.unconvertible = ""  # why vLLM's KV cannot be converted ("" while it can, or before vLLM registered it)
        self.exports: dict[str, ExportedKV] = {}  # kvmesh request id -> its read-out
        self.imports: dict[str, Imported] = {}  # kvmesh request id -> the pushed KV it starts from
        self.emit: Callable[[str, ExportedKV], None] = lambda rid, kv: None  # a piece of a push, to its stream
        self.block_ids: Callable[[str], list[int]] = lambda req_id: []  # a vLLM request's blocks now
        self.loaded_blocks = 0  # vLLM blocks written from the pool or a push
        self.scheduled = (0, 0)  # the step being run: the tokens vLLM scheduled, in how many requests
        self.refused: dict[str, str] = {}  # kvmesh request id -> why its push could not be used
        self.used: set[str] = set()  # kvmesh request ids whose push vLLM started from (loaded, or held already)
        self.pool_loaded: set[str] = set()  # kvmesh request ids that were given blocks from the pool
        self.lock = threading.Lock()  # staged: written on the event loop, read on the engine thread

    def stage(self, seed: int, tokens: Sequence[int], first_block: int, data: memoryview, n: int) -> int:
        """Keep ``n`` verified wire blocks of ``tokens`` (from ``first_block`` on) for the request that will need
        them; the oldest go beyond ``capacity``. Returns how many were staged."""
        bs, nbytes = self.wire.block_size, self.wire.block_nbytes
        keys = block_keys(seed, tokens[:(first_block + n) * bs], bs)[first_block:]
        flat = data.cast("B") if data.format != "B" else data
        with self.lock:
            for i, key in enumerate(keys):
                self.staged[key] = flat[i * nbytes:(i + 1) * nbytes]
                self.staged.move_to_end(key)
            while len(self.staged) > self.capacity:
                self.staged.popitem(last=False)
        return len(keys)

    def hits(self, keys: list[BlockKey], start: int) -> int:
        """Whole vLLM blocks from vLLM block ``start`` on whose kvmesh blocks are all staged."""
        n = 0
        with self.lock:
            while (start + n + 1) * self.per <= len(keys) and all(
                    k in self.staged for k in keys[(start + n) * self.per:(start + n + 1) * self.per]):
                n += 1
        return n

    def take(self, keys: list[BlockKey]) -> torch.Tensor:
        """The staged wire blocks of ``keys``, as one tensor ``[len(keys), *block_shape]`` (a copy)."""
        with self.lock:
            raw = b"".join(self.staged[k] for k in keys)
        return wire_tensor(bytearray(raw), self.wire).view(len(keys), *self.wire.block_shape)


def wire_tensor(data: Any, wire: KVLayout) -> torch.Tensor:
    """The bytes of wire blocks (a writable buffer) as a flat tensor of the wire dtype, without copying."""
    raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return raw.view(TORCH_DTYPES[wire.dtype])


@dataclass
class Imported:
    """A verified push for a decode request: wire blocks ``first_block ..`` of its prompt, every layer."""

    first_block: int
    blocks: torch.Tensor  # [n, *wire.block_shape]


@dataclass
class _Load:
    block_ids: list[int]
    blocks: torch.Tensor  # the wire blocks that fill them


@dataclass
class _Save:
    """Blocks ``first .. end-1`` (kvmesh's) of a request this step completes, read out layer group by group:
    ``vllm_ids`` are the vLLM blocks that hold them, from vLLM block ``first // per``."""

    kvmesh_id: str
    vllm_ids: list[int]
    first: int
    end: int
    num_tokens: int
    keys: tuple[BlockKey, ...]
    bounds: tuple[int, ...]
    final: bool
    done: int = 0


@dataclass
class _Export:
    """A prefill's push plan (its ``ExportPlan``) and how far it got."""

    kvmesh_id: str
    request: Any
    next_block: int
    bounds: tuple[int, ...]


@dataclass
class KvmeshMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


class KvmeshConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        bridge_id = self._kv_transfer_config.kv_connector_extra_config.get("bridge", "")
        self.bridge = BRIDGES[bridge_id]
        self._pending: dict[str, tuple[int, int]] = {}  # vLLM request id -> (first vLLM block, blocks) to load
        self._loads: list[_Load] = []
        self._exports: dict[str, _Export] = {}  # vLLM request id -> its push plan
        self._layer_index: dict[str, int] = {}

    # ---- scheduler side ----------------------------------------------------------------------------------------
    def _keys(self, request: Any) -> list[BlockKey]:
        lora = request.lora_request.lora_name if request.lora_request is not None else ""
        seed = self.bridge.namespace(request.cache_salt or "", lora)
        bv = self.bridge.vllm_block_size
        usable = (request.num_prompt_tokens - 1) // bv * bv  # whole vLLM blocks short of the last token
        return block_keys(seed, request.prompt_token_ids[:usable], self.bridge.wire.block_size)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self.bridge.paged is None:
            return 0, False
        params = request.kv_transfer_params or {}
        if params.get("kvmesh_import"):
            return self._import_tokens(request, params["kvmesh_id"], num_computed_tokens), False
        if not self.bridge.staged or request.skip_reading_prefix_cache:  # the canary's recompute reads nothing
            return 0, False
        start = num_computed_tokens // self.bridge.vllm_block_size
        n = self.bridge.hits(self._keys(request), start)
        self._pending[request.request_id] = (start, n)
        return n * self.bridge.vllm_block_size, False

    def _import_tokens(self, request: Any, rid: str, local: int) -> int:
        """Prompt tokens a push brings past vLLM's local hit ``local``, short of the last one (vLLM computes
        it and samples the first token from it); 0 when the push starts past the local hit."""
        imported = self.bridge.imports.get(rid)
        if imported is None:
            return 0
        start = imported.first_block * self.bridge.wire.block_size
        if local < start:
            self.bridge.refused[rid] = (f"the push starts at token {start} but vLLM holds only the first {local} "
                                        "(evicted before the request was admitted)")
            return 0
        external = max(0, request.num_prompt_tokens - 1 - local)
        if external == 0:  # vLLM holds all of it already: the push is not loaded, nor computed again
            self.bridge.used.add(rid)
        return external

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("kvmesh_plan"):
            first, groups = params["kvmesh_plan"]
            self._exports[request.request_id] = _Export(params["kvmesh_id"], request, first,
                                                        layer_bounds(self.bridge.wire.num_layers, groups))
        if params.get("kvmesh_import") and num_external_tokens > 0:
            self._load_import(request, params["kvmesh_id"], blocks, num_external_tokens)
            return
        start, n = self._pending.pop(request.request_id, (0, 0))
        n = min(n, num_external_tokens // self.bridge.vllm_block_size)
        if n <= 0:
            return
        ids = list(blocks.get_block_ids()[0][start:start + n])
        keys = self._keys(request)[start * self.bridge.per:(start + n) * self.bridge.per]
        self._loads.append(_Load(ids, self.bridge.take(keys)))
        if (rid := params.get("kvmesh_id")) is not None:
            self.bridge.pool_loaded.add(rid)

    def _load_import(self, request: Any, rid: str, blocks: Any, num_external_tokens: int) -> None:
        """The pushed blocks that cover the external tokens, as whole vLLM blocks (the tail of the last one,
        past the prompt, zeros: vLLM never reads it)."""
        imported = self.bridge.imports.pop(rid)
        self.bridge.used.add(rid)
        bv, per = self.bridge.vllm_block_size, self.bridge.per
        local = request.num_prompt_tokens - 1 - num_external_tokens  # whole vLLM blocks, at or past the push
        v0, v1 = local // bv, -(-(request.num_prompt_tokens - 1) // bv)
        wire = torch.zeros((v1 - v0) * per, *self.bridge.wire.block_shape, dtype=imported.blocks.dtype)
        have = imported.blocks[v0 * per - imported.first_block:][:wire.shape[0]]
        wire[:have.shape[0]] = have
        self._loads.append(_Load(list(blocks.get_block_ids()[0][v0:v1]), wire))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._loads = KvmeshMetadata(self._loads), []
        self.bridge.scheduled = (scheduler_output.total_num_scheduled_tokens,
                                 len(scheduler_output.num_scheduled_tokens))
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            if (x := self._exports.get(req_id)) is not None and (save := self._save(req_id, x, n)) is not None:
                meta.saves.append(save)
        return meta

    def _save(self, req_id: str, x: _Export, n: int) -> _Save | None:
        """What of ``x``'s request the step that computes ``n`` more tokens completes (before this step its
        ``num_computed_tokens``: the scheduler advances it after building the metadata)."""
        request, bs, per = x.request, self.bridge.wire.block_size, self.bridge.per
        after = request.num_computed_tokens + n
        prompt = request.num_prompt_tokens
        if after > prompt:  # decoding past the prompt: nothing of the push is left
            return None
        last = after == prompt
        end = -(-after // bs) if last else after // bs  # the last chunk: its partial block too
        if end <= x.next_block:
            return None
        lora = request.lora_request.lora_name if request.lora_request is not None else ""
        keys = tuple(block_keys(self.bridge.namespace(request.cache_salt or "", lora),
                                request.prompt_token_ids[:after], bs))
        ids = self.bridge.block_ids(req_id)[x.next_block // per:-(-end // per)]
        save = _Save(x.kvmesh_id, ids, x.next_block, end, after, keys, x.bounds, last)
        x.next_block = end
        return save

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._exports.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        rid = params.get("kvmesh_id")
        mover = self.bridge.mover
        if rid is None or not params.get("kvmesh_export") or mover is None:
            return False, None
        bs, bv = self.bridge.wire.block_size, self.bridge.vllm_block_size
        computed = request.num_computed_tokens
        full = computed // bs
        if full == 0:
            return False, None
        try:
            wire = mover.read_now(list(block_ids[:-(-full * bs // bv)]))[:full]
        except Exception:
            log.exception("request %s: reading its KV out of vLLM failed", rid)
            return False, None
        lora = request.lora_request.lora_name if request.lora_request is not None else ""
        keys = block_keys(self.bridge.namespace(request.cache_salt or "", lora), request.all_token_ids[:full * bs],
                          bs)
        data = wire.contiguous().view(torch.uint8).reshape(-1).numpy().data
        self.bridge.exports[rid] = ExportedKV(data, full, 0, computed, tuple(keys))
        return False, None

    # ---- worker side ---------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's KV, described layer by layer (``layout.describe``); what cannot be converted is refused loudly:
        said once at start, with what to set, and carried in the heartbeat (``Bridge.unconvertible``), so the
        router neither pairs this instance for a hand-off nor counts on the pool for it."""
        ordered = sorted(kv_caches.items(), key=lambda item: int(m[1]) if (m := _LAYER.search(item[0])) else -1)
        self._layer_index = {name: i for i, (name, _) in enumerate(ordered)}
        try:
            layers = [vllm_cache(self._vllm_config, name, t) for name, t in ordered]
            paged = PagedLayout(layers, self.bridge.wire, self.bridge.vllm_block_size)
        except Unconvertible as e:
            self.bridge.unconvertible = str(e)
            log.error("vLLM's KV cannot be converted to kvmesh's wire layout: %s. This instance serves without the "
                      "pool and without PD hand-offs (its heartbeat says so: the router does not pair it)", e)
            return
        self.bridge.paged, self.bridge.mover = paged, Mover(paged)
        log.info("vLLM's KV: %s", paged.describe())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        mover = self.bridge.mover
        if mover is None or not isinstance(meta, KvmeshMetadata) or not meta.loads:
            return
        mover.load([(load.block_ids, load.blocks) for load in meta.loads])
        self.bridge.loaded_blocks += sum(len(load.block_ids) for load in meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.bridge.mover is not None:
            self.bridge.mover.wait_layer(self._layer_index.get(layer_name, -1))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """After layer ``layer_name`` wrote its KV: the layer groups that end here, read out and handed over."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        mover = self.bridge.mover
        if mover is None or not isinstance(meta, KvmeshMetadata) or not meta.saves:
            return
        layers = self._layer_index.get(layer_name, -1) + 1
        for save in meta.saves:
            if layers in save.bounds:
                self._read_out(mover, save, layers)

    def _read_out(self, mover: Mover, save: _Save, layers: int) -> None:
        """Layers ``save.done .. layers`` of ``save``'s blocks, read out (on CUDA off the compute stream) and
        emitted as one piece of the push."""
        per, group = self.bridge.per, (save.done, layers)
        skip, n = save.first - save.first // per * per, save.end - save.first
        save.done = layers

        def emit(wire: torch.Tensor) -> None:
            part = wire[skip:skip + n].contiguous()
            data = part.view(torch.uint8).reshape(-1).numpy().data
            self.bridge.emit(save.kvmesh_id, ExportedKV(data, n, save.first, save.num_tokens, save.keys, False,
                                                        group))
        try:
            mover.read(save.vllm_ids, group, emit)
        except Exception:  # the push is incomplete: decode will not get every layer, and recomputes
            log.exception("request %s: reading its KV out of vLLM failed", save.kvmesh_id)

    def wait_for_save(self) -> None:
        if self.bridge.mover is not None:
            self.bridge.mover.settle()

    def shutdown(self) -> None:
        if self.bridge.mover is not None:
            self.bridge.mover.close()


def vllm_cache(vllm_config: Any, name: str, tensor: torch.Tensor) -> LayerCache:
    """What vLLM registered for layer ``name``, with what its attention backend says of it: the backend's name,
    its cache dtype and scales, the resolved ``KVCacheLayout``, and on a CPU the kernel that packs the pages."""
    layer = vllm_config.compilation_config.static_forward_context.get(name)
    backend = layer.attn_backend.get_name() if getattr(layer, "attn_backend", None) is not None else ""
    cache_dtype = str(getattr(layer, "kv_cache_dtype", None) or vllm_config.cache_config.cache_dtype)
    try:
        kv_layout = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    except (AttributeError, ValueError):  # not resolved: the tensor's strides alone say it
        kv_layout = ""
    isa = str(getattr(layer, "isa", "") or "")
    if backend == "CPU_ATTN" and not isa:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(vllm_config.model_config.dtype, vllm_config.cache_config.block_size,
                            getattr(layer, "head_size", None), cache_dtype)
    return LayerCache(tensor, backend, cache_dtype, kv_layout, isa,
                      float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)),
                      mla=type(layer).__name__ == "MLAAttention")
