"""The explicit converter of a hand-off between engines whose wire layouts differ in the storage dtype alone
(``contracts.layout.converter``): a verified push is cast, part by part, into the receiving engine's layout before
the engine imports it. Only an instance that names the sender's dtype (``engine.kv_convert_from``) takes such a push,
and the router pairs a prefill with a decode only then; anything else is refused as a layout mismatch."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvmesh.contracts.engine import ImportedKV, KVPart
from kvmesh.contracts.layout import KVLayout, converter

if TYPE_CHECKING:
    import torch

_TORCH = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}


def convert_import(kv: ImportedKV, dst: KVLayout) -> ImportedKV:
    """``kv`` in ``dst``'s layout (itself when they are equal); ValueError when no converter relates them or a
    part landed in place (only parts in the receiver's own layout may)."""
    how = converter(kv.layout, dst)
    if how is None:
        raise ValueError(f"no converter from the pushed KV's layout ({kv.layout.to_dict()}) to this engine's "
                         f"({dst.to_dict()})")
    if not how:
        return kv
    parts = []
    for part in kv.parts:
        if part.data is None:
            raise ValueError("a part in another layout landed in place; it must be buffered and converted")
        parts.append(KVPart(part.first_block, part.num_blocks, part.layers, cast(part.data, kv.layout.dtype,
                                                                                  dst.dtype)))
    return dataclasses.replace(kv, layout=dst, parts=tuple(parts))


def cast(data: Any, src: str, dst: str) -> memoryview:
    """The elements of ``data`` (raw bytes of dtype ``src``) cast to ``dst``, as new bytes; into fp8, saturating."""
    import torch

    raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    y = cast_tensor(raw.view(getattr(torch, _TORCH[src])), getattr(torch, _TORCH[dst]))
    return memoryview(y.contiguous().view(torch.uint8).numpy().data)


def cast_tensor(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as ``dtype``; into fp8, saturating (a plain cast makes out-of-range values NaN)."""
    import torch

    if dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        return x.float().clamp(-limit, limit).to(dtype)
    return x.to(dtype)
