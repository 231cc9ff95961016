"""The engine: model + paged KV + prefix cache + scheduler + sampling, stepped by its owner.

Threading: an ``LLMEngine`` is not thread-safe. One owner (a CLI loop, or a service's single engine thread)
calls ``add_request`` / ``abort`` / ``step``; services hand work to that owner through a queue.

Fault isolation: an exception while masking one sequence's logits by its grammar, sampling, computing its
logprobs, stop-checking, detokenizing or exporting one sequence aborts that sequence only (its ``StepOutput`` is
finished with ``finish_reason="error"`` and ``error`` set); a failed forward pass fails that step's sequences the
same way. Either way the engine serves the next step.

KV export: a request's ``ExportPlan`` picks its strategy (``engine/export.py``); the step asks it what to read out
during the forward pass, after it, and when the request finishes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvmesh.contracts.engine import EngineRequest, ImportedKV, TokenLogprobs
from kvmesh.contracts.events import EventSink
from kvmesh.contracts.keys import Namespace, block_keys
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.names import PrefillOrder
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.contracts.slo import SLO
from kvmesh.engine.attention import ForwardBatch, SeqSlice, make_backend
from kvmesh.engine.block_manager import BlockManager
from kvmesh.engine.canary import Canary, Check, Verdict
from kvmesh.engine.errors import SequenceError
from kvmesh.engine.eviction import make_policy
from kvmesh.engine.export import Export, KVReadout, LayerExport, make_export
from kvmesh.engine.kv_cache import DeviceKVPool, HostKVPool, KVPiece, Landed, received_blocks
from kvmesh.engine.lora import LoRABatch, LoRAManager, LoRASpec
from kvmesh.engine.model import LlamaModel
from kvmesh.engine.sampling import History, RowFault, Tally, make_generator, sample, token_logprobs
from kvmesh.engine.scheduler import Scheduled, Scheduler
from kvmesh.engine.sequence import Sequence, Status
from kvmesh.model_source.hf_config import ModelConfig
from kvmesh.settings import EngineSettings

if TYPE_CHECKING:
    from kvmesh.engine.grammar import Grammars, GrammarState
    from kvmesh.model_source.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)
_GRAMMARS_LOCK = threading.Lock()
PROMPT_LOGPROB_ROWS = 256  # prompt rows whose logits exist at once (each [vocab] float32: ~50 MB for a 49k vocab)
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None
    cached_tokens: int = 0
    exported: KVReadout | None = None
    error: SequenceError | None = None  # the request failed (finished, finish_reason "error"); others did not
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token, when the request asked
    # with the first token, when the request set ``prompt_logprobs``: one per prompt token after the first
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    ttft_s: float
    decode_tokens_per_s: float
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when the request asked
    error: SequenceError | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when the request set prompt_logprobs


# Called on the engine thread right after each forward pass with the request ids of the rows about to be sampled
# and their logits; returns the logits they are sampled from (the engine's one seam between the model and the
# sampler: tests stand in a model going nan for one request with it).
LogitsHook = Callable[[list[str], torch.Tensor], torch.Tensor]


class StepReport(NamedTuple):
    """What one step ran, for its owner's pacing and metrics: when it began, its wall and engine-thread CPU
    seconds, its rows, of them those computing one generated token (``decode_rows``), and the others' prompt
    chunks, ``(first position, tokens)`` each. No rows: no forward pass (nothing to run, or imported first tokens
    handed out)."""

    began: float
    seconds: float
    cpu_seconds: float
    rows: int = 0
    decode_rows: int = 0
    prompt_chunks: tuple[tuple[int, int], ...] = ()

    @property
    def tokens(self) -> int:
        """The tokens the step computed (0: no forward pass)."""
        return self.decode_rows + sum(n for _, n in self.prompt_chunks)

    @property
    def decode_only(self) -> bool:
        return self.decode_rows == self.rows


class Step(NamedTuple):
    outputs: list[StepOutput]
    report: StepReport


class _Tracked:
    """Per-request state owned by the engine: incremental detokenizer, stop-string matching, grammar, export,
    the penalties' tally."""

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer | None, export: Export | None = None) -> None:
        self.seq = seq
        self.detok = detok
        self.text = ""
        self.export = export  # how its KV leaves (None: it does not)
        self.error: SequenceError | None = None
        self.grammar: GrammarState | None = None  # a structured-output request's matcher
        self.logprobs: list[TokenLogprobs] = []  # of the tokens so far, when the request asked
        # its prompt's, by the position of the token they score (1 ..), as its prefill chunks compute them
        self.prompt_logprobs: dict[int, TokenLogprobs] = {}
        self.tally: Tally | None = None  # a penalized request's tokens over the vocabulary (made when first needed)

    def resume(self, earlier: list[int]) -> None:
        """Start where another instance stopped: the grammar and the detokenizer take the request's earlier
        output tokens (their text already went out), so the stop strings and the next text see them. ValueError
        when they do not fit the grammar."""
        for token in earlier:
            if self.grammar is not None:
                try:
                    self.grammar.accept(token)
                except RuntimeError as e:
                    raise ValueError(f"the tokens already generated do not fit the output's grammar: {e}") from None
            if self.detok is not None:
                self.text += self.detok.push(token)


def _check_device(device: str) -> None:
    """RuntimeError saying what to do when ``device`` is CUDA and this torch cannot reach it."""
    if not device.startswith("cuda") or torch.cuda.is_available():
        return
    why = (f"this torch ({torch.__version__}) is a CPU build" if torch.version.cuda is None
           else f"this torch (CUDA {torch.version.cuda}) sees no GPU")
    raise RuntimeError(f"device={device}, but {why}: set device=cpu, or install torch's CUDA build "
                       "(README: Install, TORCH_INDEX)")


class LLMEngine:
    def __init__(self, cfg: EngineSettings, model_config: ModelConfig | None = None,
                 on_event: EventSink | None = None, seed: int = 0, logits_hook: LogitsHook | None = None) -> None:
        """Load ``cfg.model`` (default: the embedded SmolLM2), or build a random-weight model of
        ``model_config`` with no tokenizer (tests, simulations)."""
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        if cfg.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"unknown dtype {cfg.dtype!r}; choose one of {sorted(COMPUTE_DTYPES)}")
        _check_device(cfg.device)
        self.cfg = cfg
        dtype = COMPUTE_DTYPES[cfg.dtype]
        self.tokenizer: Tokenizer | None = None
        if model_config is None:
            self.model, self.fingerprint, self.tokenizer = _load_model(cfg, dtype)
        else:
            self.fingerprint = f"random-{seed}-{hash_config(model_config)}"
            self.model = LlamaModel(model_config, dtype, cfg.device, native_gemm=cfg.native_gemm,
                                    native_pointwise=cfg.native_pointwise)
            self.model.init_random(seed)
        self.model_config = mc = self.model.cfg
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        self.layout = KVLayout(self.fingerprint, mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.block_size,
                               cfg.kv_dtype)
        num_blocks = cfg.num_blocks or max(8, cfg.kv_cache_mb * 2**20 // self.layout.block_nbytes)
        self.kv = DeviceKVPool(self.layout, num_blocks, dtype, cfg.device)
        self.blocks = _block_manager(cfg, self.kv, on_event)
        self.scheduler = Scheduler(self.blocks, cfg.max_batched_tokens, cfg.max_num_seqs,
                                   one_order=cfg.prefill_order == PrefillOrder.LEAST_WORK)
        self.scheduler.max_loras = cfg.max_loras
        self.loras = LoRAManager(mc, cfg.max_loras, cfg.max_lora_rank, dtype, cfg.device)
        for name, path in cfg.lora_adapter_paths():
            self.loras.load(name, path)
        self.attn = make_backend(cfg.attention, mc.num_heads, mc.num_kv_heads, mc.head_dim, cfg.device, dtype,
                                 self.kv.dtype)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids if self.tokenizer else mc.eos_token_ids)
        self._requests: dict[str, _Tracked] = {}
        self._grammars: Grammars | None = None  # built at the first constrained request
        self._namespaces: dict[tuple[str, str], int] = {}
        self.last_logits: tuple[list[str], torch.Tensor] = ([], torch.empty(0))
        self._pending: list[StepOutput] = []  # outputs produced outside a forward step (imported first tokens)
        # KV pieces read out during a forward pass (``export_layer_groups``) go here at once, on the engine's
        # thread (an AsyncEngine hands them to the request's stream); None: they come with the step's outputs
        self.on_piece: Callable[[StepOutput], None] | None = None
        self._pieces: list[StepOutput] = []
        self.default_slo = SLO(cfg.slo_ttft_s, cfg.slo_itl_s)  # for requests that set no target
        # requests with a target that finished (stop / length), by whether they met their targets (goodput)
        self.slo_outcomes = dict.fromkeys(("met", "missed", "missed_ttft", "missed_itl"), 0)
        self.logits_hook = logits_hook
        self.canary = Canary(cfg.canary_share, cfg.canary_budget, cfg.canary_chunk_tokens, seed=seed)

    # ---- requests ------------------------------------------------------------------------------------------
    def namespace_seed(self, cache_salt: str = "", lora_id: str = "") -> int:
        key = (cache_salt, lora_id)
        if key not in self._namespaces:
            tok_fp = self.tokenizer.fingerprint if self.tokenizer else ""
            self._namespaces[key] = Namespace(self.fingerprint, tok_fp, lora_id, cache_salt).seed
        return self._namespaces[key]

    # ---- LoRA adapters -------------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> LoRASpec:
        """Register adapter ``name`` from a PEFT directory (replacing one of that name: requests in flight
        keep the weights they started with; new ones get the new weights and new block keys). ValueError
        naming what to fix; the engine keeps serving either way."""
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> LoRASpec:
        """Forget adapter ``name`` (KeyError if unknown); requests in flight under it finish on its weights."""
        return self.loras.unload(name)

    def request_seed(self, cache_salt: str = "", lora: str = "") -> int:
        """The namespace seed of a request's block keys: its salt and its adapter's ``name@generation``."""
        spec = self.lora_spec(lora)
        return self.namespace_seed(cache_salt, spec.lora_id if spec else "")

    def lora_adapters(self) -> list[tuple[str, str]]:
        """``(name, generation)`` of every adapter this engine serves."""
        return self.loras.listing()

    def lora_spec(self, name: str) -> LoRASpec | None:
        """The adapter ``name`` (None for "", the base model); ValueError naming those served if unknown."""
        if not name:
            return None
        spec = self.loras.registered.get(name)
        if spec is None:
            served = sorted(self.loras.registered) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r}; this engine serves {served}")
        return spec

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler and cache (xgrammar is loaded on first use). Thread-safe, like
        ``grammars.compile``: a service compiles a request's grammar off the engine thread before adding it."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer; this engine has none")
            with _GRAMMARS_LOCK:
                if self._grammars is None:
                    from kvmesh.engine.grammar import Grammars

                    self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size,
                                              sorted(self.eos_token_ids))
        return self._grammars

    def add_request(self, request: EngineRequest) -> Sequence:
        """Queue a request. Raises ValueError (nothing queued) when it can never run.

        ``session``: the session it belongs to; once it finished, the session holds its blocks (a session-aware
        eviction strategy keeps them, or lets them go first when it was the session's last request).
        ``slo``: its latency targets (``engine.slo_ttft_s`` / ``slo_itl_s`` where it sets none); its TTFT counts
        from ``waited_s`` seconds ago (its arrival at the mesh). An imported request's first token is already
        made: only its ITL target applies here.

        ``lora``: the name of a loaded adapter to run it under ("" = the base model); its KV is keyed by the
        adapter's ``name@generation``, so it never shares blocks with the base model or another adapter.

        ``export``: read its KV out as the plan says (``engine/export.py``), into ``StepOutput.exported``: at the
        finish (with the last token), and with ``BY_CHUNK`` / ``BY_LAYER_GROUP`` also as outputs with no token and
        ``exported.final`` False, after each prefill chunk's pass or during it (layer groups are handed to
        ``on_piece`` as the pass writes them), so the caller can send them while the rest computes.
        ``imported``: its prompt's KV computed by a prefill instance (blocks from ``first_block`` on, in this
        engine's layout; the ones before must be cached here, e.g. pinned by ``blocks.pin``); the request starts
        decoding at once. When the pool has no room for it, it is queued and recomputed instead
        (``seq.num_cached_tokens`` then tells what was reused locally).
        ``generated``: the last ``generated`` prompt tokens are the request's output so far, from another
        instance: they count towards ``max_tokens``, seeded sampling goes on from their position, and the grammar,
        the detokenizer and the stop strings start from them.
        """
        self._check(request)
        kv = request.imported
        blocks = received_blocks(kv, self.layout) if kv is not None else None
        tracked = self._track(request)
        self._requests[request.request_id] = tracked
        if kv is not None and blocks is not None and self._start_imported(tracked.seq, kv, blocks):
            return tracked.seq
        if request.session is not None:  # a paused session is back: its KV is kept while the request queues
            self.blocks.session_back(request.session.key)
        self.scheduler.add(tracked.seq)
        return tracked.seq

    def _check(self, request: EngineRequest) -> None:
        """ValueError saying why ``request`` can never run here."""
        prompt, params, generated = request.prompt, request.params, request.generated
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if not 0 <= generated < min(len(prompt), params.max_tokens):
            raise ValueError(f"{generated} tokens already generated: there must be fewer than the prompt's "
                             f"{len(prompt)} tokens and max_tokens ({params.max_tokens})")
        total = len(prompt) - generated + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt) - generated} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds the model's context of {self.max_model_len} tokens")
        if -(-total // self.cfg.block_size) > self.kv.num_blocks:
            raise ValueError(f"request needs {total} tokens of KV but the pool holds "
                             f"{self.kv.num_blocks * self.cfg.block_size}; raise kv_cache_mb")

    def _track(self, request: EngineRequest) -> _Tracked:
        """A new request's sequence (its namespace, adapter and latency targets) and the engine's state of it
        (detokenizer, grammar, export). ValueError for an adapter not served, or earlier output its grammar
        refuses."""
        spec = self.lora_spec(request.lora)  # ValueError naming the adapters served
        params, prompt, generated = request.params, list(request.prompt), request.generated
        grammar = self.grammars.start(params.structured) if params.structured is not None else None
        seq = Sequence(request.request_id, prompt, params,
                       self.namespace_seed(request.cache_salt, spec.lora_id if spec else ""), request.retention,
                       lora=spec, earlier_outputs=generated, session=request.session,
                       waited=max(0.0, request.waited_s))
        targets = request.slo.or_else(self.default_slo)
        if targets.ttft_s and request.imported is None and not generated:  # a migrated request's first token is out
            seq.ttft_deadline = seq.mesh_arrival + targets.ttft_s
        seq.itl_target = targets.itl_s
        detok = None
        if self.tokenizer is not None:
            from kvmesh.model_source.tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        tracked = _Tracked(seq, detok, make_export(request.export))
        tracked.grammar = grammar
        if generated:
            tracked.resume(prompt[len(prompt) - generated:])
        return tracked

    def _start_imported(self, seq: Sequence, kv: ImportedKV, blocks: list[KVPiece] | Landed) -> bool:
        """Start ``seq`` decoding from its pushed KV, prefill's first token out with the next step. False when the
        pool has no room for it, or the request asks for logprobs the push did not bring (prefill computed them
        from logits decode never sees): it is then recomputed, and the blocks it landed in go back."""
        seq.output_token_ids.append(kv.first_token)
        usable = (seq.params.logprobs is None or kv.first_logprobs is not None) and seq.params.prompt_logprobs is None
        if usable and self.scheduler.has_room() and self.blocks.import_prefix(seq, blocks, kv.num_tokens,
                                                                              kv.first_block):
            seq.num_cached_tokens = kv.num_tokens
            self._offer_reuse(seq, imported=True)
            self.scheduler.add_running(seq)
            seq.output_token_ids.pop()
            self._pending.append(self._emit(seq, kv.first_token, time.monotonic(), kv.first_logprobs))
            return True
        seq.output_token_ids.pop()
        if isinstance(blocks, Landed):
            self.blocks.release_reserved(blocks.lease)
        return False

    def abort(self, request_id: str) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None and tracked.seq.status is not Status.FINISHED:
            self.scheduler.finish(tracked.seq, "abort")

    def active_requests(self) -> list[str]:
        return list(self._requests)

    def release(self, request_id: str) -> None:
        """Forget a finished request whose outputs were consumed step by step (no ``completion`` call)."""
        self._requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- stepping ------------------------------------------------------------------------------------------
    def step(self, chunk_tokens: int | None = None) -> Step:
        """One step: the imported first tokens waiting, else a forward pass over the rows the scheduler picks
        (prompt tokens beside decode rows capped at ``chunk_tokens``, the owner's pacer's; None: the whole token
        budget). Its outputs, and a report of what it ran."""
        began, began_cpu = time.monotonic(), time.thread_time()
        if self._pending:  # deliver imported first tokens before spending a forward step
            pending, self._pending = self._pending, []
            return Step(pending, StepReport(began, time.monotonic() - began, time.thread_time() - began_cpu))
        rows = self.scheduler.schedule(chunk_tokens)
        if any(seq.lora is not None for seq, _ in rows):  # each adapter's rows one contiguous group
            rows = sorted(rows, key=lambda s: s.seq.lora_name)
        decode_rows, chunks = _work(rows)  # before the pass moves the sequences on
        outputs = self._forward(rows) if rows else []
        return Step(outputs, StepReport(began, time.monotonic() - began, time.thread_time() - began_cpu,
                                        len(rows), decode_rows, chunks))

    def _forward(self, scheduled: list[Scheduled]) -> list[StepOutput]:
        """The forward pass over ``scheduled`` and what comes of it: KV read out, tokens sampled. A failed pass
        fails those sequences."""
        slices, tokens, sample_idx, samplers, groups, scored = _inputs(scheduled)
        try:
            batch = ForwardBatch.build(slices, tokens, self.cfg.block_size, sample_idx, self.cfg.device)
            if scored:
                batch.hidden_idx = torch.tensor([i for span in scored for i in span.rows], dtype=torch.long,
                                                device=self.cfg.device)
            lora = (LoRABatch([(self.loras.weights(spec), slice(a, b)) for spec, a, b in groups])
                    if groups else None)
            exports = self._during_pass(scheduled)
            for seq, _ in scheduled:
                self._offer_reuse(seq)
            logits = self.model(batch, self.kv, self.attn, lora, self._layer_hook(exports) if exports else None)
        except Exception as e:  # this step's sequences fail; the engine serves the next step
            log.exception("forward pass failed for %d sequences", len(scheduled))
            return self._take_pieces() + [self._fail(seq, SequenceError(
                seq.request_id, f"the forward pass failed: {type(e).__name__}: {e}")) for seq, _ in scheduled]
        pending = self._take_pieces()
        failed = self._exports_done(exports) if exports else []
        if scored:
            failed += self._score_prompts(scored, batch.hidden)
        if failed:  # their export or scoring failed: those are not sampled
            pending += failed
            keep = [i for i, s in enumerate(samplers) if s.status is not Status.FINISHED]
            samplers, logits = [samplers[i] for i in keep], logits[keep]
        if self.logits_hook is not None:
            logits = self.logits_hook([s.request_id for s in samplers], logits)
        self.last_logits = ([s.request_id for s in samplers], logits)  # introspection for tests and tools
        for seq, n in scheduled:
            if seq.status is Status.FINISHED:  # failed while its KV was read out
                continue
            seq.num_computed_tokens += n
            self.blocks.cache_computed_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                pending += self._after_pass(seq)
        return pending + self._sampled(samplers, logits) if samplers else pending

    # ---- the KV canary (engine/canary.py) -------------------------------------------------------------------
    def _offer_reuse(self, seq: Sequence, imported: bool = False) -> None:
        """A sequence's first pass starts on a reused prefix (or its pushed KV was just imported): maybe check
        it later, against a copy of the blocks as they are now."""
        if seq.reuse_offered or seq.lora is not None:  # an adapter may be unloaded before the check runs
            return
        seq.reuse_offered = True
        bs = self.cfg.block_size
        n = seq.num_cached_tokens // bs
        if n == 0 or (not imported and seq.num_computed_tokens != seq.num_cached_tokens) or not self.canary.wants():
            return
        tokens = seq.prompt_token_ids[:n * bs]
        keys = block_keys(seq.namespace_seed, tokens, bs)
        served = self.kv.read_blocks(seq.block_table[:n])
        self.canary.pending.append(Check(seq.request_id, self.canary.path_of(keys, imported), tokens, keys, served))

    def canary_step(self) -> None:
        """One chunk of the oldest pending check (on the engine thread, while it has nothing else to do); the
        check's verdict once its last chunk ran."""
        c = self.canary.pending[0]
        t0, cpu0 = time.monotonic(), time.thread_time()
        try:
            self._canary_chunk(c)
        except Exception:  # the check is dropped, the engine serves on
            log.exception("KV canary: the check of request %s failed", c.request_id)
            self.canary.pending.remove(c)
        self.canary.spent(time.monotonic() - t0, time.thread_time() - cpu0)

    def _canary_chunk(self, c: Check) -> None:
        bs, n_blocks = self.cfg.block_size, len(c.keys)
        if c.scratch is None:
            c.scratch = DeviceKVPool(self.layout, n_blocks, self.kv.compute_dtype, self.cfg.device)
        scratch = c.scratch
        assert isinstance(scratch, DeviceKVPool)
        n = min(self.canary.chunk_tokens, len(c.tokens) - c.done)
        table = list(range(n_blocks))
        batch = ForwardBatch.build([SeqSlice(0, n, c.done + n, table)], [c.tokens[c.done:c.done + n]], bs, [n - 1],
                                   self.cfg.device)
        self.model(batch, scratch, self.attn)
        c.done += n
        if c.done >= len(c.tokens):
            self.canary.pending.pop(0)
            verdict = self.canary.judge(c, scratch.read_blocks(table))
            if verdict.bad_blocks:
                self._diverged(verdict)

    def _diverged(self, verdict: Verdict) -> None:
        c = verdict.check
        first = verdict.bad_blocks[0]
        bad = [c.keys[i] for i in verdict.bad_blocks]
        quarantined = self.blocks.quarantine(c.keys[first:])
        log.error("KV canary: request %s's reused prefix (%s) diverged from a recompute: blocks %s (keys %s), "
                  "relative error %.3g; %d keys quarantined", c.request_id, c.path.value, verdict.bad_blocks,
                  ", ".join(f"{k:016x}" for k in bad), verdict.error, len(quarantined))
        self.canary.quarantined(quarantined, c.path)

    def _sampled(self, samplers: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """Each sampled row's token and logprobs, emitted; a fault in either fails that request alone."""
        new_tokens = self._sample(samplers, logits)
        logprobs = self._logprobs(samplers, logits, new_tokens)
        now = time.monotonic()
        out = []
        for seq, tok, lp in zip(samplers, new_tokens, logprobs):
            if isinstance(tok, RowFault):
                fault = tok
            elif isinstance(lp, RowFault):
                fault = lp
            else:
                out.append(self._emit(seq, tok, now, lp))
                continue
            out.append(self._fail(seq, SequenceError(seq.request_id, fault.message, fault.client_fault)))
        return out

    def time_forward(self, rows: list[tuple[int, int]]) -> float:
        """Seconds of one forward pass over dummy rows, each ``(first position, tokens)`` with its logits, as a
        step of those rows takes (the engine's calibration at start: ``AsyncEngine.calibrate``). Their KV goes
        to blocks no request holds, all rows to the same ones. Only on an engine that holds nothing yet (no
        request, no cached block): RuntimeError otherwise."""
        if self._requests or self.blocks.num_cached_blocks or self.blocks.num_free_blocks < self.kv.num_blocks:
            raise RuntimeError("time_forward runs only on an engine that holds no request and no KV yet")
        bs = self.cfg.block_size
        blocks = -(-max(first + n for first, n in rows) // bs)
        if blocks > self.kv.num_blocks:
            raise ValueError(f"rows reach past the {self.kv.num_blocks} blocks of the KV pool")
        table = list(range(blocks))
        slices, tokens, sample_idx, start = [], [], [], 0
        vocab = self.model_config.vocab_size
        for first, n in rows:
            slices.append(SeqSlice(start, n, first + n, table))
            tokens.append([(first + i) * 7919 % vocab for i in range(n)])
            start += n
            sample_idx.append(start - 1)
        batch = ForwardBatch.build(slices, tokens, bs, sample_idx, self.cfg.device)
        began = time.monotonic()
        self.model(batch, self.kv, self.attn, None, None)
        if self.kv.k.device.type == "cuda":
            torch.cuda.synchronize()
        return time.monotonic() - began

    def _sample(self, samplers: list[Sequence], logits: torch.Tensor) -> list[int | RowFault]:
        """One token per row (or the row's fault), grammar masks applied. ``sample`` isolates its rows; should
        the batch still fail (a grammar's mask, say), each row is masked and sampled alone, so only the row at
        fault fails, and the others get the tokens they get alone (fresh generators: same draws)."""
        states = [self._requests[s.request_id].grammar for s in samplers]
        params = [s.params for s in samplers]
        histories = [self._history(s, logits) if s.params.penalized else None for s in samplers]
        adjusted = histories if any(h is not None for h in histories) else None

        def generators(rows: list[Sequence]) -> list[torch.Generator | None]:
            return [make_generator(s.params, s.earlier_outputs + len(s.output_token_ids)) for s in rows]

        try:
            mask = self._grammars.mask(states) if self._grammars is not None else None
            return sample(logits, params, generators(samplers), mask, adjusted)
        except Exception:
            log.exception("sampling %d rows failed; sampling each alone", len(samplers))
        out: list[int | RowFault] = []
        for i, seq in enumerate(samplers):
            try:
                mask = self._grammars.mask([states[i]]) if self._grammars is not None else None
                out.append(sample(logits[i:i + 1], [params[i]], generators([seq]), mask,
                                  [histories[i]] if adjusted else None)[0])
            except Exception as e:
                log.exception("request %s: sampling failed", seq.request_id)
                out.append(RowFault(f"sampling failed: {type(e).__name__}: {e}", client_fault=False))
        return out

    def _history(self, seq: Sequence, logits: torch.Tensor) -> History:
        """What ``seq``'s penalties, ``min_tokens`` and bias read (``sampling.History``) over ``logits``' vocabulary,
        on their device; its ``Tally`` is made at its first sampled token and kept up to date by ``_append``."""
        tracked = self._requests[seq.request_id]
        if tracked.tally is None:
            earlier = seq.prompt_token_ids[len(seq.prompt_token_ids) - seq.earlier_outputs:]
            tracked.tally = Tally(logits.shape[-1], seq.prompt_token_ids + seq.output_token_ids,
                                  (earlier if seq.earlier_outputs else []) + seq.output_token_ids, logits.device)
        p = seq.params
        return History(tracked.tally, tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.eos_token_ids)))

    def _logprobs(self, samplers: list[Sequence], logits: torch.Tensor,
                  tokens: list[int | RowFault]) -> list[TokenLogprobs | RowFault | None]:
        """The logprobs of each sampled row whose request asks for them (None for the others), all such rows in
        one batched op; should that fail, each row alone, so only the row at fault fails."""
        out: list[TokenLogprobs | RowFault | None] = [None] * len(samplers)
        asked = {i: (tok, n) for i, (seq, tok) in enumerate(zip(samplers, tokens))
                 if (n := seq.params.logprobs) is not None and isinstance(tok, int)}
        rows = list(asked)
        if not rows:
            return out

        def compute(rs: list[int]) -> list[TokenLogprobs]:
            return token_logprobs(logits[rs], [asked[i][0] for i in rs], [asked[i][1] for i in rs])

        try:
            for i, lp in zip(rows, compute(rows)):
                out[i] = lp
            return out
        except Exception:
            log.exception("computing logprobs of %d rows failed; computing each alone", len(rows))
        for i in rows:
            try:
                out[i] = compute([i])[0]
            except Exception as e:
                log.exception("request %s: computing logprobs failed", samplers[i].request_id)
                out[i] = RowFault(f"computing logprobs failed: {type(e).__name__}: {e}", client_fault=False)
        return out

    def _score_prompts(self, scored: list[_Scored], hidden: torch.Tensor | None) -> list[StepOutput]:
        """Each scored prompt chunk's logprobs (``SamplingParams.prompt_logprobs``) from the final hidden states
        the pass kept, ``PROMPT_LOGPROB_ROWS`` rows of logits at a time; a request whose scoring fails fails
        alone (its failure returned)."""
        failed, at = [], 0
        for span in scored:
            rows, at = slice(at, at + len(span.rows)), at + len(span.rows)
            seq = span.seq
            try:
                if hidden is None:
                    raise RuntimeError("the forward pass kept no hidden states")
                top = seq.params.prompt_logprobs or 0
                targets = seq.prompt_token_ids[span.first + 1:span.first + 1 + len(span.rows)]
                tracked = self._requests[seq.request_id].prompt_logprobs
                h = hidden[rows]
                for a in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                    part = targets[a:a + PROMPT_LOGPROB_ROWS]
                    lps = token_logprobs(self.model.logits(h[a:a + len(part)]), part, [top] * len(part), ranked=True)
                    for i, lp in enumerate(lps):
                        tracked[span.first + 1 + a + i] = lp
            except Exception as e:
                log.exception("request %s: computing its prompt's logprobs failed", seq.request_id)
                failed.append(self._fail(seq, SequenceError(
                    seq.request_id, f"computing the prompt's logprobs failed: {type(e).__name__}: {e}")))
        return failed

    def _emit(self, seq: Sequence, token: int, now: float, logprobs: TokenLogprobs | None = None) -> StepOutput:
        """``_append``, with a failure (stop check, detokenizer, KV export) aborting this sequence only."""
        try:
            return self._append(seq, token, now, logprobs)
        except Exception as e:  # reported to this request's caller
            log.exception("request %s failed after sampling token %d", seq.request_id, token)
            return self._fail(seq, SequenceError(seq.request_id, f"{type(e).__name__}: {e}"))

    def _fail(self, seq: Sequence, error: SequenceError) -> StepOutput:
        """Abort ``seq`` (its blocks go back) and say why in its last output."""
        tracked = self._requests.get(seq.request_id)
        if tracked is not None:
            tracked.error = error
        if seq.status is not Status.FINISHED:
            try:
                self.scheduler.finish(seq, "error")
            except Exception:  # it still fails with its own error
                log.exception("request %s: could not release its blocks", seq.request_id)
                seq.status, seq.finish_reason = Status.FINISHED, "error"
        return StepOutput(seq.request_id, [], "", True, "error", seq.num_cached_tokens, error=error)

    def _append(self, seq: Sequence, token: int, now: float, logprobs: TokenLogprobs | None = None) -> StepOutput:
        tracked = self._requests[seq.request_id]
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.record_token(now)
        seq.output_token_ids.append(token)
        if tracked.tally is not None:
            tracked.tally.add(token)
        if logprobs is not None:
            tracked.logprobs.append(logprobs)
        if tracked.grammar is not None:
            tracked.grammar.accept(token)
        reason = self._finish_reason(seq, token)
        stopped = reason == "stop"  # by EOS or a stop token: that token adds no text (vLLM's rule)
        delta = tracked.detok.push(token) if tracked.detok is not None and not stopped else ""
        if tracked.grammar is not None and tracked.grammar.terminated:
            reason = "stop"  # the object (string, choice) is complete
        if seq.params.stop and delta and seq.earlier_outputs + len(seq.output_token_ids) > seq.params.min_tokens:
            text = tracked.text + delta
            window = len(delta) + max(len(s) for s in seq.params.stop)
            hits = [i for s in seq.params.stop if (i := text.find(s, max(0, len(text) - window))) >= 0]
            if hits:
                delta = text[len(tracked.text):min(hits)] if min(hits) >= len(tracked.text) else ""
                text = text[:min(hits)]
                reason = "stop"
            tracked.text = text
        else:
            tracked.text += delta
        exported = None
        if reason is not None:
            if tracked.export is not None:
                exported = self._readout(seq, tracked.export.at_finish(seq, self.cfg.block_size),
                                         seq.num_computed_tokens)
            self.scheduler.finish(seq, reason)
            self._count_slo(seq)
        prompt = self._prompt_logprobs(seq, tracked) if len(seq.output_token_ids) == 1 else []
        return StepOutput(seq.request_id, [token], delta, reason is not None, reason, seq.num_cached_tokens,
                          exported, logprobs=[logprobs] if logprobs is not None else [], prompt_logprobs=prompt)

    @staticmethod
    def _prompt_logprobs(seq: Sequence, tracked: _Tracked) -> list[TokenLogprobs]:
        """The prompt's logprobs in order, for its first output (none when the request did not ask)."""
        if seq.params.prompt_logprobs is None:
            return []
        scored = tracked.prompt_logprobs
        missing = [i for i in range(1, len(seq.prompt_token_ids)) if i not in scored]
        if missing:  # every prompt position is computed here (no reused prefix): a gap is the engine's bug
            raise RuntimeError(f"the prompt's logprobs miss positions {missing[:8]}")
        return [scored[i] for i in range(1, len(seq.prompt_token_ids))]

    def _count_slo(self, seq: Sequence) -> None:
        """A request with a target finished: did it meet them (``slo_outcomes``, the engine's goodput)?"""
        if seq.ttft_deadline is None and not seq.itl_target:
            return
        ttft, itl = seq.slo_met()
        self.slo_outcomes["met" if ttft and itl else "missed"] += 1
        self.slo_outcomes["missed_ttft"] += not ttft
        self.slo_outcomes["missed_itl"] += not itl

    def _during_pass(self, scheduled: list) -> list[LayerExport]:
        """The chunks of this step whose export strategy reads them out during the pass, layer group by group."""
        out = []
        bs, layers = self.cfg.block_size, self.model_config.num_layers
        for seq, n in scheduled:
            tracked = self._requests.get(seq.request_id)
            export = tracked.export if tracked is not None else None
            if export is not None and (x := export.during_pass(seq, n, bs, layers)) is not None:
                out.append(x)
        return out

    def _layer_hook(self, exports: list[LayerExport]) -> Callable[[int], None]:
        """The forward pass's ``kv_written``: at each group's end layer, that slice of each chunk's blocks is
        read out (one strided copy) and handed over at once. A failed read-out fails that request only."""
        def kv_written(layers: int) -> None:
            for x in exports:
                if x.error is not None or layers not in x.bounds:
                    continue
                try:
                    data = self.kv.read_blocks(x.seq.block_table[x.first:x.end], (x.done, layers))
                except Exception as e:  # the request fails after the pass (_exports_done)
                    log.exception("request %s: reading out its KV failed", x.seq.request_id)
                    x.error = e
                    continue
                piece = KVReadout(data, x.num_tokens, x.block_keys, x.first, final=False, layers=(x.done, layers))
                x.done = layers
                out = StepOutput(x.seq.request_id, [], cached_tokens=x.seq.num_cached_tokens, exported=piece)
                if self.on_piece is None:
                    self._pieces.append(out)
                else:
                    self.on_piece(out)
        return kv_written

    def _take_pieces(self) -> list[StepOutput]:
        pieces, self._pieces = self._pieces, []
        return pieces

    def _exports_done(self, exports: list[LayerExport]) -> list[StepOutput]:
        """After the pass: what each chunk read out is off the request's to-do; a failed one fails it."""
        failed = []
        for x in exports:
            if x.error is not None:
                failed.append(self._fail(x.seq, SequenceError(
                    x.seq.request_id, f"reading out its KV failed: {type(x.error).__name__}: {x.error}")))
            elif (tracked := self._requests.get(x.seq.request_id)) is not None and tracked.export is not None:
                tracked.export.passed(x)
        return failed

    def _after_pass(self, seq: Sequence) -> list[StepOutput]:
        """After a prefill chunk: what its export strategy reads out now, as an output with no token (none when
        it reads out nothing). A failed read-out fails this request only."""
        tracked = self._requests.get(seq.request_id)
        if tracked is None or tracked.export is None:
            return []
        if (todo := tracked.export.after_pass(seq, self.cfg.block_size)) is None:
            return []
        try:
            piece = self._readout(seq, *todo, final=False)
        except Exception as e:  # reported to this request's caller
            log.exception("request %s: reading out its KV failed", seq.request_id)
            return [self._fail(seq, SequenceError(seq.request_id, f"{type(e).__name__}: {e}"))]
        return [StepOutput(seq.request_id, [], cached_tokens=seq.num_cached_tokens, exported=piece)]

    def _readout(self, seq: Sequence, first: int, n: int, final: bool = True) -> KVReadout:
        """Blocks ``first ..`` of ``seq`` up to its token ``n`` (whole blocks), and the keys of its full blocks."""
        bs = self.cfg.block_size
        return KVReadout(self.blocks.export_prefix(seq, first, n), n,
                         block_keys(seq.namespace_seed, seq.all_token_ids[:n], bs), first, final)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.earlier_outputs + len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- convenience -----------------------------------------------------------------------------------------
    def completion(self, request_id: str) -> Completion:
        """The result of a finished request (and forget it)."""
        tracked = self._requests.pop(request_id)
        seq = tracked.seq
        ttft = (seq.first_token_time or seq.arrival) - seq.arrival
        decode_s = time.monotonic() - (seq.first_token_time or time.monotonic())
        n = len(seq.output_token_ids)
        return Completion(request_id, seq.prompt_token_ids, list(seq.output_token_ids), tracked.text,
                          seq.finish_reason, seq.num_cached_tokens, ttft,
                          (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0, tracked.logprobs, tracked.error,
                          self._prompt_logprobs(seq, tracked) if n else [])

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 cache_salt: str = "", lora: str | list[str] = "") -> list[Completion]:
        """Run prompts to completion together (continuous batching) and return them in order; ``lora``: one
        adapter name for all, or one per prompt ("" = the base model)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        llist = lora if isinstance(lora, list) else [lora] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p, name in zip(ids, prompts, plist, llist):
            self.add_request(EngineRequest(rid, tuple(prompt), p, cache_salt, name))
        while any(self._requests[r].seq.status is not Status.FINISHED for r in ids):
            self.step()
        return [self.completion(r) for r in ids]


def _load_model(cfg: EngineSettings, dtype: torch.dtype) -> tuple[LlamaModel, str, Tokenizer]:
    """``cfg.model`` loaded: the model, its fingerprint and its tokenizer."""
    from kvmesh.engine.loader import load_weights, resolve_model
    from kvmesh.model_source.tokenizer import Tokenizer

    source = resolve_model(cfg.model)
    model = LlamaModel(source.config, dtype, cfg.device, native_gemm=cfg.native_gemm,
                       native_pointwise=cfg.native_pointwise)
    model.load_hf_weights(load_weights(source, dtype))
    # the quantized blocks serve the C kernel only (CPU, fp32, one thread): elsewhere the file is not read again
    if cfg.quantized_weights and source.gguf is not None and model.lm_head.lib is not None:
        from kvmesh.engine.loader import load_quantized

        switched, total = model.use_quantized(load_quantized(source.gguf))
        log.info("%d of %d matrices read from %s's quantized blocks", switched, total, source.gguf.name)
    return model, source.fingerprint, Tokenizer.from_dir(source.hf_dir)


def _block_manager(cfg: EngineSettings, kv: DeviceKVPool, on_event: EventSink | None) -> BlockManager:
    """The blocks of ``kv`` and the prefix cache over them: a host tier of ``cfg.host_cache_mb``, evicting by
    ``cfg.eviction``."""
    host = None
    if cfg.host_cache_mb > 0:
        host = HostKVPool(kv.layout, max(1, cfg.host_cache_mb * 2**20 // kv.layout.block_nbytes))
    policy = make_policy(cfg.eviction)
    if (sessions := getattr(policy, "sessions", None)) is not None:  # a session-aware strategy's table
        sessions.default_pause_s, sessions.idle_s = cfg.session_pause_s, cfg.session_idle_s
    return BlockManager(kv, host, policy, on_event, cfg.enable_prefix_caching)


def _work(scheduled: list[Scheduled]) -> tuple[int, tuple[tuple[int, int], ...]]:
    """A step's decode rows (one generated token each) and its prompt chunks, ``(first position, tokens)``."""
    decode_rows, chunks = 0, []
    for seq, n in scheduled:
        begin = seq.num_computed_tokens
        if n == 1 and begin >= len(seq.prompt_token_ids):
            decode_rows += 1
        else:
            chunks.append((begin, n))
    return decode_rows, tuple(chunks)


class _Scored(NamedTuple):
    """A prompt chunk whose logprobs are wanted: the flat rows of the batch at its positions ``first ..``, each
    scoring the prompt token after it."""

    seq: Sequence
    first: int
    rows: range


def _inputs(scheduled: list[Scheduled]) -> tuple[list[SeqSlice], list[list[int]], list[int], list[Sequence],
                                                 list[tuple[LoRASpec, int, int]], list[_Scored]]:
    """The forward pass's inputs for ``scheduled``: each row's slice of the batch and its tokens, the positions
    whose logits are sampled and their sequences, each adapter's rows as one ``(adapter, start, end)``, and the
    prompt chunks whose logprobs are wanted (every prompt position but the last, which is sampled)."""
    slices, tokens, sample_idx, samplers, scored = [], [], [], [], []
    groups: list[tuple[LoRASpec, int, int]] = []
    start = 0
    for seq, n in scheduled:
        if seq.lora is not None:
            if groups and groups[-1][0] is seq.lora:
                groups[-1] = (seq.lora, groups[-1][1], start + n)
            else:
                groups.append((seq.lora, start, start + n))
        begin = seq.num_computed_tokens
        slices.append(SeqSlice(start, n, begin + n, seq.block_table))
        tokens.append(seq.all_token_ids[begin:begin + n])
        if seq.scores_prompt and begin < (last := len(seq.prompt_token_ids) - 1):
            scored.append(_Scored(seq, begin, range(start, start + min(n, last - begin))))
        start += n
        if begin + n == seq.num_tokens:
            sample_idx.append(start - 1)
            samplers.append(seq)
    return slices, tokens, sample_idx, samplers, groups, scored


def hash_config(cfg: ModelConfig) -> str:
    import hashlib

    return hashlib.sha256(repr(cfg).encode()).hexdigest()[:16]
