"""The KV canary on a real stack (a role-both instance with the tiny random model, cachesvc with its pool, the
router): a cached block corrupted in place is caught after it was served, quarantined on the instance, and the
pool hears of it and stops serving its copy."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from tests.integration.test_router_bad_input import TinyMesh, tiny_model_dir


@pytest.fixture(scope="module")
def mesh(nats_server, tmp_path_factory) -> Iterator[TinyMesh]:
    with TinyMesh(nats_server.url, tiny_model_dir(tmp_path_factory.mktemp("model")), cachesvc=True,
                  roles=("both",), engine={"canary_share": 1.0, "canary_budget": 1.0}) as m:
        yield m


def _complete(mesh: TinyMesh, text: str) -> dict:
    status, body, _ = mesh.post("/v1/completions", {"model": mesh.router.model_id, "prompt": text, "max_tokens": 2,
                                                    "temperature": 0})
    assert status == 200, body
    return body


def _corrupt_cached_blocks(engine) -> int:
    """Swap layers 0 and 1 of every cached block (a layout fault after every checksum was taken)."""
    ids = [n.block_id for n in engine.blocks.tree.by_key.values() if n.block_id is not None]
    for t in (engine.kv.k, engine.kv.v):
        swapped = t[1, ids].clone()
        t[1, ids] = t[0, ids]
        t[0, ids] = swapped
    return len(ids)


def test_a_corrupted_cached_block_is_caught_quarantined_and_the_pool_stops_serving_it(mesh):
    text = uuid.uuid4().hex * 3
    _complete(mesh, text)
    time.sleep(1.0)  # written back to the pool
    host = mesh.workers[0]
    assert mesh.call(host.engine.call(_corrupt_cached_blocks)) > 0
    served = _complete(mesh, text)  # reuses the corrupted blocks
    assert served["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not mesh.cache.pool.quarantined:
        time.sleep(0.2)  # the canary runs while the engine is idle, then tells cachesvc
    assert host.engine.canary_counts().get(("local", "diverged"), 0) >= 1
    assert mesh.cache.pool.quarantined
