"""The trace reader and the TTFT waterfall: finding a request, attributing TTFT, rendering it."""

from __future__ import annotations

import json

import pytest
from kvmesh.telemetry import render
from kvmesh.telemetry.spans import SpanRecord, find, read_spans, subtree
from kvmesh.telemetry.waterfall import waterfall

MS = 1_000_000
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def span(name, sid, parent, start_ms, end_ms, service="router", trace_id=TRACE, **attrs) -> SpanRecord:
    events = []
    if "first_ms" in attrs:
        events = [{"name": "first_token", "time_ns": int(attrs.pop("first_ms") * MS), "attributes": {}}]
    return SpanRecord(trace_id, sid, parent, name, service, int(start_ms * MS), int(end_ms * MS),
                      attributes=attrs, events=events, instance=service)


def mesh_request(rid: str = "req-1", trace_id: str = TRACE, parent: str | None = None) -> list[SpanRecord]:
    """A disaggregated request as the services trace it: TTFT = 100 ms, prefill.compute dominant."""
    p = rid[-1]  # distinct span ids per request
    return [
        span("router.request", f"r{p}", parent, 0, 300, trace_id=trace_id, first_ms=100,
             **{"kvmesh.request_id": rid}),
        span("router.tokenize", f"t{p}", f"r{p}", 0.5, 2, trace_id=trace_id),
        span("router.route", f"o{p}", f"r{p}", 2, 6, trace_id=trace_id),
        span("cachesvc.match_prefix", f"m{p}", f"o{p}", 3, 5, trace_id=trace_id),
        span("router.dispatch", f"d{p}", f"r{p}", 6, 299, trace_id=trace_id),
        span("decode.request", f"D{p}", f"d{p}", 7, 299, "decode", trace_id=trace_id,
             **{"kvmesh.segment": False}),
        span("prefill.request", f"P{p}", f"d{p}", 8, 80, "prefill", trace_id=trace_id),
        span("prefill.queue", f"q{p}", f"P{p}", 9, 10, "prefill", trace_id=trace_id),
        span("prefill.compute", f"c{p}", f"P{p}", 10, 70, "prefill", trace_id=trace_id),
        span("kv.push", f"k{p}", f"P{p}", 71, 79, "prefill", trace_id=trace_id),
        span("kv.ready", f"y{p}", f"P{p}", 79.5, 81, "decode", trace_id=trace_id),
        span("decode.load", f"l{p}", f"D{p}", 81, 90, "decode", trace_id=trace_id),
        span("decode.first_token", f"f{p}", f"D{p}", 90, 92, "decode", trace_id=trace_id),
        span("decode.generate", f"g{p}", f"D{p}", 92, 298, "decode", trace_id=trace_id,
             **{"kvmesh.segment": False, "kvmesh.itl_ms.p50": 20.0, "kvmesh.itl_ms.p90": 25.0,
                "kvmesh.itl_ms.p99": 30.0, "kvmesh.itl_ms.max": 30.0, "kvmesh.itl.count": 9}),
        span("router.respond", f"s{p}", f"r{p}", 95, 100, trace_id=trace_id),
    ]


def by_name(wf):
    return {g.name: g for g in wf.segments}


def test_segments_add_up_to_the_ttft_and_the_dominant_one_is_marked():
    spans = mesh_request()
    wf = waterfall(spans[0], spans)
    assert wf.ttft_ns == 100 * MS and wf.unattributed_ns == 0
    assert wf.attributed_ns == wf.ttft_ns
    assert wf.dominant.name == "prefill.compute" and wf.dominant.ttft_ns == 60 * MS
    assert sum(g.share for g in wf.segments) == pytest.approx(1.0)


def test_the_deepest_active_span_takes_the_time_and_parents_keep_only_their_self_time():
    spans = mesh_request()
    seg = by_name(waterfall(spans[0], spans))
    assert seg["cachesvc.match_prefix"].ttft_ns == 2 * MS
    assert seg["router.route"].ttft_ns == 2 * MS and seg["router.route"].has_children
    assert seg["router.route"].label == "router.route (self)"
    # dispatch holds only the hops: 6-8 before prefill started and 92-95 from decode back to the router
    assert seg["router.dispatch"].ttft_ns == 5 * MS
    assert seg["prefill.request"].ttft_ns == (1 + 1 + 0.5) * MS  # handoffs between its steps
    # kv.ready starts inside prefill.request (at publish): the later, equally deep span wins
    assert seg["kv.ready"].ttft_ns == 1.5 * MS


def test_a_push_overlapping_the_compute_takes_only_the_time_it_runs_on_alone():
    spans = mesh_request()
    push = next(s for s in spans if s.name == "kv.push")  # pushing chunk by chunk since 30 ms, 9 ms past compute
    spans[spans.index(push)] = span("kv.push", push.span_id, push.parent_id, 30, 79, "prefill",
                                    **{"kvmesh.background": True})
    seg = by_name(waterfall(spans[0], spans))
    assert seg["prefill.compute"].ttft_ns == 60 * MS
    assert seg["kv.push"].ttft_ns == 9 * MS


def test_a_span_that_only_waits_and_what_runs_after_the_first_token_take_no_ttft():
    spans = mesh_request()
    seg = by_name(waterfall(spans[0], spans))
    assert "decode.request" not in seg and "decode.generate" not in seg


def test_time_no_span_covers_is_reported_not_hidden():
    spans = [span("router.request", "r", None, 0, 50, first_ms=40),
             span("router.tokenize", "t", "r", 0, 10)]
    wf = waterfall(None, spans[1:] + [span("x", "x", None, 30, 40)])  # no router span: no TTFT
    assert wf.ttft_ns is None and wf.segments == []
    root_less = [span("router.request", "r", None, 10, 50, first_ms=40), span("a", "a", "r", 10, 20)]
    wf = waterfall(root_less[0], root_less)
    assert wf.ttft_ns == 30 * MS and wf.unattributed_ns == 0
    assert by_name(wf)["router.request"].ttft_ns == 20 * MS


def test_a_request_without_a_first_token_has_no_ttft():
    spans = [span("router.request", "r", None, 0, 50, **{"kvmesh.request_id": "x"})]
    wf = waterfall(spans[0], spans)
    assert wf.ttft_ns is None and "no first token" in render.text(wf)


def write(path, spans):
    path.write_text("".join(json.dumps(vars(s)) + "\n" for s in spans))
    return read_spans(path)


def test_find_by_request_id_trace_id_or_prefix(tmp_path):
    other_trace = "f" * 32
    spans = write(tmp_path / "t.jsonl", mesh_request("req-1") + mesh_request("req-2", other_trace))
    root, tree = find(spans, "req-2")
    assert root.request_id == "req-2" and {s.trace_id for s in tree} == {other_trace} and len(tree) == 15
    assert find(spans, TRACE)[0].request_id == "req-1"
    assert find(spans, TRACE[:8])[0].request_id == "req-1"
    assert find(spans, "nope") == (None, [])


def test_two_requests_in_one_callers_trace_are_told_apart(tmp_path):
    both = mesh_request("req-1", parent="caller") + mesh_request("req-2", parent="caller")
    spans = write(tmp_path / "t.jsonl", both)
    root, tree = find(spans, "req-1")
    assert {s.span_id for s in tree} == {s.span_id for s in mesh_request("req-1")}
    assert subtree(spans, root) == tree


def test_text_waterfall_lists_segments_their_share_and_the_dominant_one():
    spans = mesh_request()
    out = render.text(waterfall(spans[0], spans), spans_tree=True)
    assert "TTFT 100.0 ms" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("prefill.compute"))
    assert "60.0" in line and "60.0%" in line and "◀ dominant" in line
    assert "sum of segments" in out and "100.0%" in out
    assert "ITL p50 20.0" in out
    assert "decode.generate" in out  # the span tree


def test_slowest_lists_worst_ttft_first_with_its_dominant_segment():
    a = mesh_request("req-1")
    b = [span("router.request", "R", None, 0, 30, trace_id="e" * 32, first_ms=20,
              **{"kvmesh.request_id": "req-9"}),
         span("router.tokenize", "T", "R", 0, 15, trace_id="e" * 32)]
    out = render.slowest([waterfall(a[0], a), waterfall(b[0], b)])
    lines = out.splitlines()
    assert "req-1" in lines[1] and "prefill.compute" in lines[1] and "req-9" in lines[2]
    assert "router.tokenize" in lines[2]


def test_html_and_png_timelines_are_written(tmp_path):
    spans = mesh_request()
    wf = waterfall(spans[0], spans)
    page = render.html_page(wf)
    assert page.startswith("<!doctype html>") and "<svg" in page and "prefill.compute" in page
    pytest.importorskip("matplotlib")
    path = render.png(wf, tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_timeline_of_a_request_without_a_first_token_is_written_too(tmp_path):
    pytest.importorskip("matplotlib")
    spans = [s for s in mesh_request() if s.service != "router"]  # no router span: no TTFT
    path = render.png(waterfall(None, spans), tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_says_which_extra_to_install(tmp_path, monkeypatch):
    import sys

    spans = mesh_request()
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what an absent package looks like to import
    with pytest.raises(RuntimeError, match=r"kvmesh\[plots\]"):
        render.png(waterfall(spans[0], spans), tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_trace_command_prints_the_waterfall_of_a_request(tmp_path, capsys):
    from app import trace_cli

    write(tmp_path / "traces.jsonl", mesh_request("req-1"))
    assert trace_cli.main(["req-1", "--state-dir", str(tmp_path), "--html", str(tmp_path / "t.html")]) == 0
    out = capsys.readouterr().out
    assert "request req-1" in out and "◀ dominant" in out and (tmp_path / "t.html").exists()
    assert trace_cli.main(["--slowest", "3", "--json", "--state-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)[0]["dominant"] == "prefill.compute"
    assert trace_cli.main(["missing", "--wait", "0", "--state-dir", str(tmp_path)]) == 1
