"""A bounded load on the real stack: 64 streaming clients, a router cap of 16 in flight. Every answer is exactly
its reference (no lost or duplicated token), what is over the cap is refused at once with 429, nothing hangs,
memory stays bounded, and the stack serves normally afterwards. (The figures: `kvmesh bench load`.)"""

from __future__ import annotations

import pytest

from app.bench import load

pytestmark = pytest.mark.slow


def test_64_streaming_clients_lose_nothing_and_overflow_is_refused_fast(tmp_path):
    res = load.run(clients=64, duration_s=15, max_concurrent=16, max_tokens=8, baseline_s=3, state_dir=tmp_path)
    s = res.load.summary()
    assert res.load.mismatches == []
    assert res.load.errors == []
    assert s["timeouts"] == 0
    assert s["completed"] >= 16
    assert s["rejected_429"] > 0 and s["reject_p99_s"] < 1.0  # refused at once, not queued
    assert res.served_after
    for name, peak in res.memory.peak.items():  # bounded: no service grows by more than 512 MiB under the load
        assert peak - res.memory.first[name] < 512, (name, res.memory.first[name], peak)
