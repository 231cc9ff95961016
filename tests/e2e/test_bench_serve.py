"""`kvmesh bench serve` against the real stack: a tiny multi-turn run end to end."""

from __future__ import annotations

import json

import pytest

from app.bench import serve

pytestmark = pytest.mark.slow


def test_a_tiny_multi_turn_run_measures_every_request_and_sees_the_conversation_reused(mesh, tmp_path):
    url = f"http://127.0.0.1:{mesh.http_port}"
    argv = ["--target", f"kvmesh={url}", "--workload", "multi-turn", "--conversations", "2", "--turns", "2",
            "--max-tokens", "4", "--concurrency", "2", "--timeout", "120", "--max-duration", "240",
            "--out", str(tmp_path), "--quiet"]
    assert serve.main(argv) == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    records = {r["key"]: r for r in run["records"]}
    assert len(records) == 4 and all(r["error"] is None for r in records.values())
    assert all(r["ttft_s"] > 0 and r["output_tokens"] >= 1 and r["text"] for r in records.values())
    assert all(len(r["itl_s"]) == r["output_tokens"] - 1 for r in records.values() if r["output_tokens"] <= 4)
    # the second turn re-sends the first turn's prompt (and reply): its cached tokens come back in `usage`
    assert all(records[f"chat{i}/1"]["cached_tokens"] >= 16 for i in (0, 1))
    assert run["summary"]["ok"] == 4 and run["summary"]["cached_ratio"] > 0
    assert (tmp_path / "summary.md").exists()
