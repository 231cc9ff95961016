"""``VLLMEngine``: vLLM's v1 ``LLMEngine`` in the instance's own process, stepped by the instance's engine thread.

Why not ``AsyncLLM``: it always runs vLLM's engine core in processes of its own, which here took 49-71 s to start
(each re-imports vLLM and torch) against 8 s in process, and would put the scheduler, the KV tensors and the KV
connector out of the host's reach. In process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor) the
engine, its scheduler and its workers are objects of this process, driven like the native engine: one thread owns
them (``EngineLoop``), adds requests and calls ``step()`` while any is unfinished, and hands each request's outputs
to its stream.

What maps to what
- The model: ``[engine] model`` resolved as for the native engine (the default GGUF converted once to an HF
  folder), so both engines of one model share its fingerprint, tokenizer and block keys.
- KV size: ``num_blocks`` (else ``kv_cache_mb``) in kvmesh blocks of ``block_size`` tokens, turned into vLLM blocks
  of ``vllm_block_size`` tokens (a multiple of ``block_size``; vLLM's CPU attention takes multiples of 32); the
  context is capped to what fits. KV dtype: vLLM keeps its cache in the model's ``dtype`` (``kv_dtype`` fp8: in
  e4m3 with per-tensor scales); the wire layout is ``kv_dtype``, and ``layout.py`` names the converter between
  them (exact where they agree). Threads: ``threads`` (OpenMP, unpinned). ``dtype``, ``max_num_seqs``,
  ``max_batched_tokens``, ``enable_prefix_caching``, ``max_loras``, ``max_lora_rank`` carry over.
- LoRA: vLLM builds its LoRA layers at start or never, and then runs them on every step, adapter or not (on CPU
  they doubled a decode step's CPU at 8-16 rows), so they are built only for an instance that may serve adapters:
  one given ``lora_adapters`` at start, or ``vllm_lora`` (adapters loaded at run time), as ``vllm serve`` builds
  them only with ``--enable-lora``.
- Adapters are given to vLLM under ``name@generation`` (the generation a digest of their files, as the native
  engine computes it), so a reload under the same name is another adapter to vLLM and its KV events name the
  kvmesh namespace directly.
- Errors: a request vLLM refuses raises ``ValueError`` (the servicers answer INVALID_ARGUMENT); the checks vLLM
  does not make (prompt + max_tokens past the context, a duplicate id, an adapter not loaded, which would kill its
  engine) are made here first. A failed step fails the requests in flight (``SequenceError``); an engine vLLM
  declares dead fails every later one too, naming the restart it needs.
- Migration: a request another instance started (``EngineRequest.generated``: its prompt ends with the tokens
  already streamed) is vLLM's prompt whole, with what is left of ``max_tokens`` and ``min_tokens``; vLLM
  detokenizes the new tokens with the prompt as context, so the text goes on where it stopped, and its presence
  and frequency penalties count the tokens streamed before as output (``penalties.py``, a logits processor every
  engine here runs; vLLM alone would count them only in the repetition penalty, as prompt). Greedy streams
  continue with the tokens an uninterrupted run gives; a seeded one restarts vLLM's generator (other tokens than
  uninterrupted), and a stop string that spans the cut is not seen. A constrained one (structured output) is refused
  (``continuation_refused``): vLLM's grammar would start over mid-response.
- KV canary: ``canary.py`` (a sampled reuse's first-token logprobs against a recompute that reads no cached KV).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import xxhash

from kvmesh.contracts.engine import (
    AdapterInfo,
    EngineLoad,
    EngineOutput,
    EngineRequest,
    EngineStats,
    ExportedKV,
    ExportPieces,
    ImportedKV,
    RequestTiming,
    SloOutcomes,
    Speed,
    StepCounts,
)
from kvmesh.contracts.events import AllBlocksCleared
from kvmesh.contracts.ids import BlockKey, NamespaceSeed
from kvmesh.contracts.keys import Namespace, block_keys
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.slo import SLO, SloTrack
from kvmesh.engine.canary import ReusePath
from kvmesh.engines.base import Engine, KVEventSink, Reserved
from kvmesh.engines.errors import SequenceError
from kvmesh.engines.loop import EngineLoop
from kvmesh.routing.cost import SpeedEstimator
from kvmesh.settings import EngineSettings
from kvmesh.vllm import check_version
from kvmesh.vllm.canary import REFERENCE_PRIORITY, TOP, Check, VLLMCanary, top_logprobs
from kvmesh.vllm.events import Subscriber, Translator, endpoints
from kvmesh.vllm.requests import client_fault, kv_hints, output, sampling_params

PENALTIES = "kvmesh.vllm.penalties:EarlierOutputs"  # the logits processor every engine runs (penalties.py)
log = logging.getLogger(__name__)
DTYPES: dict[str, Literal["float32", "bfloat16", "float16"]] = {"fp32": "float32", "bf16": "bfloat16",
                                                                 "fp16": "float16"}
CPU_BLOCK_SIZE = 128  # vLLM's default on CPU (its attention takes multiples of 32)
TOPIC = "kvmesh"


@dataclass
class _Request:
    request: EngineRequest
    timing: RequestTiming | None
    lora: str = ""        # the vLLM name of its adapter ("" = the base model)
    first: bool = True    # no output delivered yet
    added: float = 0.0    # when vLLM took it (time.monotonic())
    slo: SloTrack | None = None  # against its targets (the engine's defaults where it sets none), when it has any
    canary: list[bytes] | None = None  # sampled by the KV canary: its prompt's vLLM block hashes


@dataclass
class _Adapter:
    info: AdapterInfo
    vllm: Any             # vLLM's LoRARequest (lora_name = name@generation)


def _environment(cfg: EngineSettings) -> None:
    """What vLLM reads at import and start: in process, unpinned OpenMP threads, no torch.compile (its first
    logprobs request compiled for a minute here), no usage reports."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if cfg.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
    for name, value in (("TORCH_COMPILE_DISABLE", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"),
                        ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)


def lora_layers(cfg: EngineSettings) -> bool:
    """Whether vLLM builds its LoRA layers: for an instance given adapters at start or ``vllm_lora``."""
    return cfg.max_loras > 0 and (bool(cfg.lora_adapter_paths()) or cfg.vllm_lora)


def adapter_generation(path: str) -> str:
    """The native engine's generation of a PEFT folder: a digest of its config and weights. ValueError naming the
    file that cannot be read."""
    root = Path(path)
    try:
        digest = xxhash.xxh3_64((root / "adapter_config.json").read_bytes())
        digest.update((root / "adapter_model.safetensors").read_bytes())
    except OSError as e:
        raise ValueError(f"LoRA adapter at {path!r}: {e.strerror or e}; pass the folder PEFT's save_pretrained "
                         f"wrote (adapter_config.json, adapter_model.safetensors)") from None
    return digest.hexdigest()


class VLLMEngine(EngineLoop, Engine):
    backend = "vllm"
    continues_requests = True  # a migrated stream: its prompt and the tokens streamed so far, as vLLM's prompt

    def __init__(self, cfg: EngineSettings, loop: asyncio.AbstractEventLoop) -> None:
        EngineLoop.__init__(self, loop, name="vllm-engine")
        from kvmesh.engine.loader import resolve_model  # converts a GGUF (the default model) once
        from kvmesh.model_source.resolve import model_name
        from kvmesh.model_source.tokenizer import Tokenizer

        self.cfg = cfg
        source = resolve_model(cfg.model)
        mc = source.config
        self.hf_dir = source.hf_dir
        self.model_name = model_name(cfg.model)
        self.tokenizer_fingerprint = Tokenizer.from_dir(source.hf_dir).fingerprint
        self.vocab_size = mc.vocab_size
        self.layout = KVLayout(source.fingerprint, mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_size,
                               cfg.kv_dtype)
        self.vllm_block_size = cfg.vllm_block_size or (CPU_BLOCK_SIZE if cfg.device == "cpu" else cfg.block_size)
        if self.vllm_block_size % cfg.block_size:
            raise ValueError(f"vllm_block_size {self.vllm_block_size} must be a multiple of block_size "
                             f"{cfg.block_size} (kvmesh's block keys are computed inside vLLM's blocks)")
        self.per_block = self.vllm_block_size // cfg.block_size
        self.adopt_unit = self.per_block  # the connector loads whole vLLM blocks only
        kv_blocks = cfg.num_blocks or max(8, cfg.kv_cache_mb * 2**20 // self.layout.block_nbytes)
        self.num_vllm_blocks = max(2, kv_blocks // self.per_block)
        capacity = self.num_vllm_blocks * self.vllm_block_size
        wanted = cfg.max_model_len or mc.max_position_embeddings
        self.max_model_len = min(wanted, capacity)
        if self.max_model_len < wanted:
            log.warning("vLLM: the context is capped at %d tokens, what %d KV blocks of %d hold (raise "
                        "num_blocks or kv_cache_mb for %d)", self.max_model_len, self.num_vllm_blocks,
                        self.vllm_block_size, wanted)
        self.translator = Translator(cfg.block_size, self._namespace_of)
        from kvmesh.vllm.connector import BRIDGES, Bridge  # imports vLLM: after _environment

        self.bridge = Bridge(self.layout, self.vllm_block_size, self._namespace_of,
                             self.num_vllm_blocks * self.per_block)
        self.bridge_id = f"{id(self):x}"
        self.bridge.emit = self._emit
        BRIDGES[self.bridge_id] = self.bridge
        self.on_events: KVEventSink | None = None
        self.events_endpoint, self.replay_endpoint = endpoints()
        self.subscriber: Subscriber | None = None
        self.llm: Any = None
        self.dead: str = ""  # why vLLM's engine died ("" while alive)
        self._active: dict[str, _Request] = {}
        self._adapters: dict[str, _Adapter] = {}
        self._lora_ids = itertools.count(1)
        self._retired: dict[str, int] = {}  # vLLM adapter name -> its id: to remove once its requests end
        self.speed_fit = SpeedEstimator()
        self.lora_on = lora_layers(cfg)
        self.steps = {"decode": StepCounts(), "prefill": StepCounts()}  # replaced whole: read by the metrics
        self.default_slo = SLO(cfg.slo_ttft_s, cfg.slo_itl_s)  # for requests that set no target
        self.slo_outcomes = dict.fromkeys(("met", "missed", "missed_ttft", "missed_itl"), 0)
        self.canary = VLLMCanary(cfg.canary_share, cfg.canary_budget, cfg.dtype, cfg.kv_dtype)

    def continuation_refused(self, structured: bool) -> str:
        return ("vLLM's structured output starts its grammar at the request's first token: it cannot continue a "
                "constrained response another instance started") if structured else ""

    @property
    def kv_unconvertible(self) -> str:
        return self.bridge.unconvertible

    # ---- start and stop --------------------------------------------------------------------------------------
    def build(self) -> None:
        """Start vLLM's engine (on the engine thread: every vLLM call is made from there)."""
        import vllm
        from vllm.config.kv_events import KVEventsConfig
        from vllm.config.kv_transfer import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine as VLLMLLMEngine

        check_version(vllm.__version__)
        cfg, layout = self.cfg, self.layout
        block_bytes = layout.block_nbytes * self.per_block
        args = EngineArgs(
            model=str(self.hf_dir), tokenizer=str(self.hf_dir), dtype=DTYPES[cfg.dtype],
            max_model_len=self.max_model_len, block_size=self.vllm_block_size,
            num_gpu_blocks_override=self.num_vllm_blocks + 1,  # vLLM's block 0 is its null block
            kv_cache_memory_bytes=(self.num_vllm_blocks + 2) * block_bytes,
            enable_prefix_caching=cfg.enable_prefix_caching, enforce_eager=cfg.device == "cpu",
            kv_cache_dtype="fp8_e4m3" if cfg.kv_dtype == "fp8" else "auto",  # else the model dtype (layout.py)
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=max(cfg.max_batched_tokens, self.vllm_block_size),
            seed=0, disable_log_stats=True, distributed_executor_backend="uni",
            # requests are served earliest deadline first: each one's priority is when it is due (SloTrack.due)
            scheduling_policy="priority",
            # a continued stream's earlier output in the presence and frequency penalties (penalties.py)
            logits_processors=[PENALTIES],
            gpu_memory_utilization=(cfg.vllm_gpu_memory_utilization if cfg.vllm_gpu_memory_utilization > 0
                                    else EngineArgs.gpu_memory_utilization),  # 0: vLLM's default
            enable_lora=self.lora_on, max_loras=max(1, cfg.max_loras),
            # vLLM types the rank as a Literal of the ranks it takes and checks the int itself; unused where vLLM
            # is not installed (then untyped)
            max_lora_rank=cfg.max_lora_rank,  # type: ignore[arg-type, unused-ignore]
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint=self.events_endpoint, replay_endpoint=self.replay_endpoint,
                                            topic=TOPIC),
            # kvmesh's connector (connector.py): pool hits loaded, finished blocks read out for the write-back
            kv_transfer_config=KVTransferConfig(kv_connector="KvmeshConnector",
                                                kv_connector_module_path="kvmesh.vllm.connector",
                                                kv_role="kv_both",
                                                kv_connector_extra_config={"bridge": self.bridge_id}))
        self.llm = VLLMLLMEngine.from_engine_args(args)
        manager = self.llm.engine_core.engine_core.scheduler.kv_cache_manager
        self.bridge.block_ids = lambda req_id: list(manager.get_block_ids(req_id)[0])
        for name, path in cfg.lora_adapter_paths():
            self._load_lora(name, path)

    async def close(self) -> None:
        from kvmesh.vllm.connector import BRIDGES

        await self.stop()
        BRIDGES.pop(self.bridge_id, None)
        if self.subscriber is not None:
            self.subscriber.close()
        for path in (self.events_endpoint, self.replay_endpoint):
            Path(path.removeprefix("ipc://")).unlink(missing_ok=True)

    # ---- the seam: requests ----------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest,
                       timing: RequestTiming | None = None) -> AsyncIterator[EngineOutput]:
        rid = request.request_id
        stream = self.open_stream(rid)
        try:
            if timing is not None:
                timing.submitted = time.monotonic()
            await self.run(lambda: self._add(request, timing))
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if self.close_stream(rid):
                self.queue(lambda: self._abort(rid))

    # ---- the seam: the prefix cache --------------------------------------------------------------------------
    def namespace(self, cache_salt: str = "", lora: str = "") -> NamespaceSeed:
        adapter = self._adapter(lora)
        return self._namespace_of(cache_salt, adapter.vllm.lora_name if adapter else "")

    def _namespace_of(self, cache_salt: str, lora_id: str) -> NamespaceSeed:
        return NamespaceSeed(Namespace(self.fingerprint, self.tokenizer_fingerprint, lora_id, cache_salt).seed)

    async def match_prefix(self, namespace: NamespaceSeed, tokens: Sequence[int], max_tokens: int) -> int:
        return self.translator.holds(namespace, tokens, max_tokens)

    def holds(self, namespace: NamespaceSeed, tokens: Sequence[int], max_blocks: int) -> int:
        return self.translator.holds(namespace, tokens, max_blocks * self.layout.block_size)

    async def pin(self, lease: str, namespace: NamespaceSeed, tokens: Sequence[int], max_blocks: int) -> int:
        """What vLLM holds of the prompt now (it cannot hold blocks for someone outside: should it evict them
        before the push is imported, the connector sees its local hit fall short of the push and vLLM computes
        the prompt instead, never a wrong token)."""
        return min(max_blocks, self.translator.holds(namespace, tokens, len(tokens)))

    def unpin(self, lease: str) -> None:
        pass

    async def reserve(self, lease: str, request: EngineRequest, first_block: int) -> Reserved | None:
        return None

    def release(self, lease: str) -> None:
        pass

    async def adopt(self, namespace: NamespaceSeed, tokens: Sequence[int], first_block: int, data: memoryview,
                    num_blocks: int) -> bool:
        """Staged for the connector, which loads them into vLLM's paged KV when vLLM admits the request that
        needs them (vLLM has no way to take blocks into its prefix cache outside a request)."""
        if self.bridge.paged is None:
            return False
        return self.bridge.stage(namespace, tokens, first_block, data, num_blocks) > 0

    async def held_blocks(self) -> list[tuple[BlockKey, str]]:
        return self.translator.snapshot()

    def subscribe(self, sink: KVEventSink) -> None:
        self.on_events = sink
        if self.subscriber is None:
            self.subscriber = Subscriber(self.events_endpoint, self.replay_endpoint, TOPIC, self._batch_arrived,
                                         self._batches_lost)

    def _batch_arrived(self, events: list[Any]) -> None:  # the subscriber's thread
        self.loop.call_soon_threadsafe(self._translate, events)

    def _translate(self, events: list[Any]) -> None:  # the event loop
        try:
            out = self.translator.translate(events)
        except Exception:
            log.exception("vLLM KV events could not be translated")
            return
        if out and self.on_events is not None:
            self.on_events(out)

    def _batches_lost(self) -> None:  # the subscriber's thread
        """Events the index will never see: start both over empty (vLLM's cache reset, the index told)."""
        def clear() -> None:
            self.translator.translate([AllBlocksCleared()])
            if self.on_events is not None:
                self.on_events([AllBlocksCleared()])
        self.queue(lambda: self.llm.reset_prefix_cache())
        self.loop.call_soon_threadsafe(clear)

    # ---- the seam: adapters ----------------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> AdapterInfo:
        return await self.run(lambda: self._load_lora(name, path))

    async def unload_lora(self, name: str) -> None:
        await self.run(lambda: self._unload_lora(name))

    def adapters(self) -> list[AdapterInfo]:
        return sorted((a.info for a in list(self._adapters.values())), key=lambda a: a.name)

    def _adapter(self, name: str) -> _Adapter | None:
        if not name:
            return None
        adapter = self._adapters.get(name)
        if adapter is None:
            served = sorted(self._adapters) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r}; this engine serves {served}")
        return adapter

    def _load_lora(self, name: str, path: str) -> AdapterInfo:
        from vllm.lora.request import LoRARequest

        if not name or "@" in name or name.strip() != name:
            raise ValueError(f"LoRA adapter name {name!r} is invalid: use a non-empty name without '@' or "
                             "surrounding spaces")
        if not self.lora_on:
            raise ValueError("LoRA adapters are off on this vLLM instance (vLLM builds its LoRA layers at start "
                             "only): start it with lora_adapters, or with vllm_lora to load adapters at run time")
        generation = adapter_generation(path)
        request = LoRARequest(f"{name}@{generation}", next(self._lora_ids), str(Path(path).resolve()))
        try:
            self.llm.add_lora(request)  # checks the files: a bad path must never reach a request
        except Exception as e:  # noqa: BLE001 - vLLM raises a bare Exception naming the problem
            raise ValueError(f"LoRA adapter {name!r} at {path!r}: {e}") from None
        rank = int(_json(Path(path) / "adapter_config.json").get("r", 0))
        info = AdapterInfo(name, generation, request.lora_path, rank)
        old = self._adapters.get(name)
        self._adapters[name] = _Adapter(info, request)
        if old is not None and old.vllm.lora_name != request.lora_name:
            self._retire(old)
        return info

    def _unload_lora(self, name: str) -> None:
        adapter = self._adapters.pop(name)  # KeyError: not loaded
        self._retire(adapter)

    def _retire(self, adapter: _Adapter) -> None:
        """Drop an adapter (unloaded, or replaced by other files) from vLLM once no request in flight runs under
        it: now, or at its last request's end (``_retired``)."""
        self._retired[adapter.vllm.lora_name] = adapter.vllm.lora_int_id
        self._drop_retired(adapter.vllm.lora_name)

    def _drop_retired(self, lora_name: str) -> None:
        if lora_name in self._retired and not any(r.lora == lora_name for r in self._active.values()):
            self.llm.remove_lora(self._retired.pop(lora_name))

    # ---- the seam: load and speed ----------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        if self.llm is None:
            return EngineLoad(0, 0, 0, 0, 0, 0, 0)
        sched = self.llm.engine_core.engine_core.scheduler
        pool = sched.kv_cache_manager.block_pool
        waiting = list(sched.waiting)
        return EngineLoad(len(sched.running), len(waiting), pool.get_num_free_blocks() * self.per_block,
                          (pool.num_gpu_blocks - 1) * self.per_block, len(self.translator.held), 0,
                          sum(r.num_tokens for r in waiting), sum(c.steps for c in self.steps.values()))

    def speed(self) -> Speed:
        return self.speed_fit.report()

    def stats(self) -> EngineStats:
        return EngineStats(self.load(), self.speed(), decode_steps=self.steps["decode"],
                           prefill_steps=self.steps["prefill"], slo=SloOutcomes(**self.slo_outcomes))

    # ---- the engine thread -------------------------------------------------------------------------------------
    def busy(self) -> bool:
        return self.llm is not None and self.llm.has_unfinished_requests()

    def _add(self, request: EngineRequest, timing: RequestTiming | None) -> None:
        from vllm.inputs import TokensPrompt

        if timing is not None:
            timing.started = time.monotonic()
        if self.dead:
            raise SequenceError(request.request_id, f"vLLM's engine died ({self.dead}); restart this instance")
        rid, prompt, p = request.request_id, list(request.prompt), request.params
        if rid in self._active:
            raise ValueError(f"request id {rid!r} is already in use")
        if not prompt:
            raise ValueError("prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) - request.generated + p.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt) - request.generated} tokens) + max_tokens ({p.max_tokens}) "
                             f"exceeds the model's context of {self.max_model_len} tokens")
        if request.generated:  # a migrated stream: vLLM gets what is left of its budget
            if p.max_tokens <= request.generated:  # it had streamed all of it: only the end was lost
                self.deliver(rid, EngineOutput(rid, (), "", True, "length"))
                return
            p = dataclasses.replace(p, max_tokens=p.max_tokens - request.generated,
                                    min_tokens=max(0, p.min_tokens - request.generated))
        adapter = self._adapter(request.lora)
        tokens = TokensPrompt(prompt_token_ids=prompt)
        if request.cache_salt:
            tokens["cache_salt"] = request.cache_salt
        # its TTFT counts from its arrival at the mesh: the wait before it reached this engine included
        slo = SloTrack(request.slo.or_else(self.default_slo), time.monotonic() - request.waited_s,
                       continued=request.generated > 0)
        sampled = self.canary.wants()
        try:
            vparams = sampling_params(p, self._transfer(request), prompt[len(prompt) - request.generated:]
                                      if request.generated else ())
            if sampled:  # the first token's top logprobs, for the canary (the client gets what it asked for)
                vparams.logprobs = max(vparams.logprobs or 0, TOP)
            # the session reaches vLLM as its own session id (in its KV events) and as an orchestrator's KV hint
            internal = self.llm.add_request(rid, tokens, vparams,
                                 lora_request=adapter.vllm if adapter else None, priority=int(slo.due * 1000),
                                 session_id=request.session.key if request.session else None,
                                 kv_hints=kv_hints(rid, request.session))
        except ValueError:
            raise
        except Exception as e:
            if client_fault(e):
                raise ValueError(str(e)) from None
            raise
        added = time.monotonic()
        hashes = None
        if sampled:  # in process, vLLM's scheduler holds the request now, its block hashes computed
            req = self.llm.engine_core.engine_core.scheduler.requests.get(internal)
            hashes = list(req.block_hashes) if req is not None else None
        self._active[rid] = _Request(request, timing, adapter.vllm.lora_name if adapter else "", added=added,
                                     slo=slo if slo.targets else None, canary=hashes)
        if timing is not None:
            timing.added = added

    def _transfer(self, request: EngineRequest) -> dict[str, Any]:
        """What the connector reads of a request (``kv_transfer_params``): its id, its export plan (a push while
        it computes, or the write-back at its end), and whether a push is staged for it."""
        out: dict[str, Any] = {"kvmesh_id": request.request_id}
        plan = request.export
        if plan is not None and plan.pieces is ExportPieces.AT_END:
            out["kvmesh_export"] = True
        elif plan is not None:
            out["kvmesh_plan"] = [plan.first_block,
                                  plan.layer_groups if plan.pieces is ExportPieces.BY_LAYER_GROUP else 1]
        if request.imported is not None:
            self.bridge.imports[request.request_id] = imported_blocks(request.imported, self.layout)
            out["kvmesh_import"] = True
        return out

    def _emit(self, rid: str, piece: ExportedKV) -> None:  # the engine thread, inside vLLM's forward pass
        self.deliver(rid, EngineOutput(rid, (), exported=piece))

    def _abort(self, rid: str) -> None:
        entry = self._active.pop(rid, None)
        for table in (self.bridge.imports, self.bridge.refused):
            table.pop(rid, None)
        self.bridge.used.discard(rid)
        self.bridge.pool_loaded.discard(rid)
        if entry is not None and not self.dead:
            self.llm.abort_request([rid])
            if entry.lora:
                self._drop_retired(entry.lora)

    def step(self) -> None:
        began = time.monotonic()
        prefill = any(r.first for r in self._active.values())
        self.bridge.scheduled = (0, 0)
        try:
            outs = self.llm.step()
            if self.bridge.mover is not None:  # a push's pieces before its first token
                self.bridge.mover.flush()
        except Exception as e:  # noqa: BLE001 - the step's requests fail; is the engine still alive?
            self._step_failed(e)
            return
        took = time.monotonic() - began
        tokens, rows = self.bridge.scheduled  # what this step computed (the connector saw vLLM's schedule)
        if tokens > rows:  # prompt tokens in it, not only one per decoding row
            self.speed_fit.observe(tokens, took)
        kind = "prefill" if prefill else "decode"
        c = self.steps[kind]
        self.steps[kind] = StepCounts(c.steps + 1, c.rows + rows, c.seconds + took)
        now = time.monotonic()
        for out in outs:
            entry = self._active.get(out.request_id)
            if entry is None:
                if self.canary.running is not None and out.request_id == self.canary.running.request_id:
                    self._reference_output(out)
                continue
            result = output(out, entry.first, entry.request.params.logprobs, entry.request.params.prompt_logprobs)
            if entry.slo is not None and result.token_ids:
                entry.slo.token(now)
            if entry.first:  # its timings before the output: the caller reads them as soon as it has it
                entry.first = False
                if entry.canary is not None:
                    self._sampled(entry, out)
                self._first_output(entry, now)
            if out.finished:
                result = dataclasses.replace(result, exported=self._last_piece(entry.request))
            self.deliver(out.request_id, result)
            if out.finished:
                del self._active[out.request_id]
                self._count_slo(entry.slo)
                if entry.lora:
                    self._drop_retired(entry.lora)

    def _count_slo(self, slo: SloTrack | None) -> None:
        """A request with a target finished: did it meet them (the engine's goodput, as the native engine's)?"""
        if slo is None:
            return
        ttft, itl = slo.met()
        self.slo_outcomes["met" if ttft and itl else "missed"] += 1
        self.slo_outcomes["missed_ttft"] += not ttft
        self.slo_outcomes["missed_itl"] += not itl

    def _last_piece(self, request: EngineRequest) -> ExportedKV | None:
        """What the finished request's export plan leaves for its last output: the write-back's read-out, or for
        a push (every block already left during the passes) none, with the keys and tokens ``kv.ready`` names."""
        rid, plan = request.request_id, request.export
        self.bridge.imports.pop(rid, None)
        exported = self.bridge.exports.pop(rid, None)
        if plan is None or plan.pieces is ExportPieces.AT_END:
            return exported
        bs = self.layout.block_size
        keys = tuple(block_keys(self.namespace(request.cache_salt, request.lora), request.prompt, bs))
        end = -(-len(request.prompt) // bs)
        return ExportedKV(memoryview(b""), 0, end, len(request.prompt), keys)

    def _first_output(self, entry: _Request, now: float) -> None:
        """The request's first token: its engine timings (computed here, or started from its pushed KV)."""
        rid = entry.request.request_id
        used = rid in self.bridge.used
        self.bridge.used.discard(rid)
        self.bridge.pool_loaded.discard(rid)
        if (why := self.bridge.refused.pop(rid, None)) is not None:
            log.warning("request %s: its pushed KV was not used, vLLM computed the prompt: %s", rid, why)
        if entry.timing is not None:
            entry.timing.first_output = now
            if not used:  # computed here (stays 0 when vLLM started from the push: decode.load says imported)
                entry.timing.scheduled = entry.added

    # ---- the KV canary (canary.py) -----------------------------------------------------------------------------
    def canary_counts(self) -> Mapping[tuple[str, str], int]:
        return dict(self.canary.core.counts)

    def on_quarantine(self, sink: Callable[[list[BlockKey], str], None]) -> None:
        def on_loop(keys: list[BlockKey], path: str) -> None:  # told on the engine thread
            self.loop.call_soon_threadsafe(sink, keys, path)

        self.canary.core.on_quarantine = on_loop

    def idle_in(self) -> float | None:
        return self.canary.due() if self.llm is not None and not self.dead else None

    def idle(self) -> None:
        """Start the reference recompute of the oldest check: its prompt again, nothing read from any cache."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        ref = self.canary.start()
        c = ref.check
        tokens = TokensPrompt(prompt_token_ids=c.prompt)
        if c.cache_salt:
            tokens["cache_salt"] = c.cache_salt
        params = VSamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP, skip_reading_prefix_cache=True,
                                 output_kind=RequestOutputKind.DELTA)
        try:
            self.llm.add_request(ref.request_id, tokens, params, lora_request=c.lora, priority=REFERENCE_PRIORITY)
        except Exception:
            log.exception("KV canary: the recompute of request %s could not start", c.request_id)
            self.canary.abandon()

    def _sampled(self, entry: _Request, out: Any) -> None:
        """A sampled request's first output: when it reused whole blocks, its check waits for an idle engine."""
        request, rid = entry.request, entry.request.request_id
        cached = out.num_cached_tokens or 0
        bs = self.layout.block_size
        served = top_logprobs(out.outputs[0].logprobs) if out.outputs else {}
        if cached < bs or not served or entry.canary is None:
            return
        prompt = list(request.prompt)
        keys = block_keys(self.namespace(request.cache_salt, request.lora), prompt, bs)
        if rid in self.bridge.used:
            path = ReusePath.HANDOFF
        elif rid in self.bridge.pool_loaded:
            path = ReusePath.POOL
        else:
            path = ReusePath.LOCAL
        adapter = self._adapter(request.lora)
        self.canary.pending.append(Check(rid, path, prompt, keys[:cached // bs], served, request.cache_salt,
                                         adapter.vllm if adapter else None, keys, entry.canary))

    def _reference_output(self, out: Any) -> None:
        ref = self.canary.running
        assert ref is not None
        if out.outputs and out.outputs[0].logprobs:
            ref.logprobs = top_logprobs(out.outputs[0].logprobs)
        if not out.finished:
            return
        check, err, bad = self.canary.finish()
        if not bad:
            return
        removed = self._evict_hashes(check.hashes)
        log.error("KV canary: request %s's reused prefix (%s, %d blocks: keys %s) gave a first token other than a "
                  "recompute's (largest logprob difference %.3g, tolerance %.3g); its prompt's %d kvmesh blocks "
                  "quarantined, %d vLLM blocks dropped from the prefix cache", check.request_id, check.path.value,
                  len(check.keys), ", ".join(f"{k:016x}" for k in check.keys), err, self.canary.tolerance,
                  len(check.prompt_keys), removed)
        self.canary.core.quarantined(check.prompt_keys, check.path)

    def _evict_hashes(self, hashes: Sequence[bytes]) -> int:
        """Drop every block cached under these vLLM block hashes from vLLM's prefix cache (a block in use keeps
        its KV for its request, but nothing matches it again); vLLM reports them removed (KV events: the index
        forgets them). Returns how many blocks were dropped."""
        from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

        pool = self.llm.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        ids: set[int] = set()
        for h in hashes:
            key = make_block_hash_with_group_id(BlockHash(h), 0)
            while (block := pool.cached_block_hash_to_block.get_one_block(key)) is not None:
                ids.add(block.block_id)
                pool.evict_blocks({block.block_id})
        return len(ids)

    def _step_failed(self, e: Exception) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        log.exception("vLLM engine step failed")
        if isinstance(e, EngineDeadError):
            self.dead = f"{type(e).__name__}: {e}"
        if self.canary.running is not None:
            rid = self.canary.running.request_id
            self.canary.abandon()
            if not self.dead:
                self.llm.abort_request([rid])
        for rid in list(self._active):
            self.deliver(rid, SequenceError(rid, f"the engine step failed: {type(e).__name__}: {e}"))
            self._abort(rid)


def imported_blocks(kv: ImportedKV, wire: KVLayout) -> Any:
    """A verified push as the connector loads it: every pushed (block, layer) placed, as wire blocks."""
    import torch

    from kvmesh.vllm.connector import Imported, wire_tensor
    from kvmesh.vllm.layout import TORCH_DTYPES

    if kv.layout != wire:
        raise ValueError("the pushed KV is in another layout than this engine's")
    n = -(-kv.num_tokens // wire.block_size) - kv.first_block
    blocks = torch.empty(n, *wire.block_shape, dtype=TORCH_DTYPES[wire.dtype])
    for part in kv.parts:
        if part.data is None:
            raise ValueError("this engine cannot take KV received in place")
        lo, hi = part.layers or (0, wire.num_layers)
        data = wire_tensor(part.data, wire).view(part.num_blocks, hi - lo, *wire.block_shape[1:])
        i = part.first_block - kv.first_block
        blocks[i:i + part.num_blocks, lo:hi] = data
    return Imported(kv.first_block, blocks)


def _json(path: Path) -> dict[str, Any]:
    import json

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


async def start_vllm(cfg: EngineSettings) -> VLLMEngine:
    """vLLM's engine for ``cfg``, started in this process (about 8 s on a CPU here, once vLLM is imported)."""
    _environment(cfg)
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(None, VLLMEngine, cfg, loop)
    engine.start()
    try:
        await engine.run(engine.build)
    except BaseException:
        await engine.stop()
        raise
    return engine
