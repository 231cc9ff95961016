"""Moving blocks between vLLM's paged KV and host memory, off the forward pass where the device allows.

On CUDA every move runs on a side stream of its own: a read-out (a push's layer group, a finished request's
write-back) waits for an event recorded on the compute stream after the layer wrote its KV, gathers the blocks on
the device into a staging tensor and copies it to pinned host memory, while the compute stream runs the next
layers; a thread waits for each copy's event and hands the host tensor on. A load (pool hits, a pushed prompt)
copies the wire blocks to the device and scatters them layer by layer, an event per layer, and the compute stream
waits for a layer's event only where that layer's attention needs it (``wait_layer``, vLLM's
``wait_for_layer_load``). ``settle`` (``wait_for_save``, end of step) orders the next step's compute after every
gather, so a block vLLM frees and reuses is never overwritten before it was read; ``flush`` waits until every
read-out was handed on (the engine calls it before delivering a step's outputs, so a push's pieces precede its
first token).

On a CPU the same calls run the same reads and writes in place, without streams: there is nothing to overlap with.

Ownership: ``read``, ``load``, ``wait_layer``, ``settle`` and ``flush`` are called on the engine thread (inside
vLLM's step); ``done`` callbacks run on the mover's thread (CUDA) or inline (CPU).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvmesh.vllm.layout import PagedLayout

log = logging.getLogger(__name__)
Done = Callable[[torch.Tensor], None]


class Mover:
    def __init__(self, paged: PagedLayout) -> None:
        self.paged = paged
        self.cuda = paged.device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(device=paged.device) if self.cuda else None
        self._layer_ready: dict[int, Any] = {}  # layer -> the event after which its loads are in place
        self._pending: queue.Queue[tuple[Any, torch.Tensor, Any, Done] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if self.cuda:
            self._thread = threading.Thread(target=self._hand_on, name="kv-d2h", daemon=True)
            self._thread.start()

    # ---- read-outs ---------------------------------------------------------------------------------------------
    def read(self, block_ids: Sequence[int], layers: tuple[int, int] | None, done: Done) -> None:
        """The wire blocks of ``block_ids`` (``layers``: that slice), to ``done`` as a host tensor: now on a CPU,
        on the mover's thread once the copy landed on CUDA."""
        if not self.cuda:
            done(self.paged.read(block_ids, layers))
            return
        written = torch.cuda.Event()
        written.record()  # on the compute stream: the layers' KV are written once it passes here
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(written)
            staged = self.paged.read(block_ids, layers)
            host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self._pending.put((copied, host, staged, done))

    def read_now(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The wire blocks of ``block_ids`` on the host, waited for (a finished request's write-back: read once,
        as vLLM frees its blocks; on CUDA the gather and copy still run on the side stream)."""
        out: list[torch.Tensor] = []
        self.read(block_ids, None, out.append)
        self.flush()
        return out[0]

    def _hand_on(self) -> None:  # the mover's thread (CUDA)
        while (item := self._pending.get()) is not None:
            copied, host, _staged, done = item
            try:
                copied.synchronize()
                done(host)
            except Exception:
                log.exception("a KV read-out from the device failed")
            finally:
                self._pending.task_done()
        self._pending.task_done()

    # ---- loads -------------------------------------------------------------------------------------------------
    def load(self, loads: Sequence[tuple[Sequence[int], torch.Tensor]]) -> None:
        """Each ``(vLLM block ids, wire blocks)`` written into vLLM's paged KV: now on a CPU; on CUDA copied and
        scattered on the side stream, layer by layer, each layer's event kept for :meth:`wait_layer`."""
        if not loads:
            return
        if not self.cuda:
            for ids, blocks in loads:
                self.paged.write(ids, blocks)
            return
        with torch.cuda.stream(self.stream):
            staged = [(ids, blocks.pin_memory().to(self.paged.device, non_blocking=True)) for ids, blocks in loads]
            for layer in range(self.paged.wire.num_layers):
                for ids, blocks in staged:
                    self.paged.write(ids, blocks, (layer, layer + 1))
                ready = torch.cuda.Event()
                ready.record(self.stream)
                self._layer_ready[layer] = ready
            for _, blocks in staged:
                blocks.record_stream(self.stream)

    def wait_layer(self, layer: int) -> None:
        """Order the compute stream after layer ``layer``'s loads (no wait on the host; nothing on a CPU)."""
        if (ready := self._layer_ready.pop(layer, None)) is not None:
            torch.cuda.current_stream().wait_event(ready)

    # ---- end of step -------------------------------------------------------------------------------------------
    def settle(self) -> None:
        """The next step's compute after every gather and load this step started (on the device, no host wait)."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._layer_ready.clear()

    def flush(self) -> None:
        """Return once every read-out started so far was handed to its ``done``."""
        if self.cuda:
            self._pending.join()

    def close(self) -> None:
        if self._thread is not None:
            self.flush()
            self._pending.put(None)
            self._thread.join(timeout=5)
            self._thread = None
