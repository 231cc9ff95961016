"""The tenant-class bench (``app/bench/slo_class.py``): which tenant runs each mode and how goodput is summed."""

from app.bench.slo_class import CLASS, CLASSES, HEADERS, TARGETS, render, schedule, tenants


def test_the_modes_alternate_so_neither_always_runs_first():
    assert schedule(2) == [HEADERS, CLASS, CLASS, HEADERS]


def test_each_run_has_a_tenant_of_its_own_whose_class_fits_its_mode():
    keys, classes = tenants(schedule(1))
    assert keys == {"key-0": "run0", "key-1": "run1"}
    assert classes == {"run0": "standard", "run1": "interactive"}


def test_the_class_carries_the_targets_the_per_request_runs_send():
    assert CLASSES["interactive"] == f"{TARGETS.ttft_s:g}/{TARGETS.itl_s:g}" == "6/0.15"
    assert CLASSES["standard"] == "0/0"


def test_goodput_is_summed_per_mode_and_the_routers_count_shown_per_run():
    def row(kind, met):
        return {"kind": kind, "ttft_s": 1.0, "itl_p99_s": 0.1, "refused": False, "ttft_met": met, "itl_met": True}

    runs = [{"mode": HEADERS, "rows": [row("stream", True), row("long", True)], "router": {"met": 2.0, "missed": 0}},
            {"mode": CLASS, "rows": [row("stream", True), row("long", False)], "router": {"met": 1.0, "missed": 1}}]
    text = render(runs)
    assert "| 2: tenant's class | 1 of 2 |" in text and text.count("| 2 / 1 |") == 1
    assert "| per-request targets | 2 of 2 | 2 |" in text and "| tenant's class | 1 of 2 | 1 |" in text
