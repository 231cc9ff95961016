"""The PD bench's request order (``app/bench/pd.py``): every stack gets every request, the order rotating; with
``back_to_back`` each stack gets a chat's turns in a row."""

from app.bench.pd import request_order

NAMES = ["both", "pd auto", "pd always"]
PLAN = [(0, 0, [1]), (0, 1, [2]), (0, 2, [3]), (1, 0, [4]), (1, 1, [5]), (1, 2, [6])]


def test_each_request_goes_to_every_stack_in_a_rotating_order():
    order = request_order(PLAN, NAMES)
    assert [(n, s[2][0]) for n, s in order[:6]] == [("both", 1), ("pd auto", 1), ("pd always", 1),
                                                    ("pd auto", 2), ("pd always", 2), ("both", 2)]
    assert sorted((n, s[2][0]) for n, s in order) == sorted((n, s[2][0]) for n in NAMES for s in PLAN)


def test_back_to_back_sends_a_stacks_turns_in_a_row_after_the_repeats_cold_prompts():
    order = [(n, s[2][0]) for n, s in request_order(PLAN, NAMES, back_to_back=True)]
    assert order[:3] == [("both", 1), ("pd auto", 1), ("pd always", 1)]  # the cold prompt, rotating as before
    assert order[3:9] == [("both", 2), ("both", 3), ("pd auto", 2), ("pd auto", 3), ("pd always", 2),
                          ("pd always", 3)]
    assert [s for _, s in order[9:12]] == [4, 4, 4]  # the next repeat's cold prompt


def _result(name, cold, chat, push_ms=None, text="t"):
    from app.bench.pd import Request, Result

    r = Result(name, cold=[Request(t, f"{name}-c{i}", 1500, text) for i, t in enumerate(cold)],
               chats=[[Request(t, f"{name}-t{i}", 95, text) for i, t in enumerate(chat)]])
    for i, q in enumerate(r.cold):
        ms = push_ms[i] if push_ms else 0.0
        r.spans[q.request_id] = {"push_bytes": 66_000_000 if ms else 0, "push_ms": ms, "critical_ms": 0.0}
    return r


def test_the_tls_report_sets_each_setup_against_its_mtls_off_twin_with_paired_ratios():
    from app.bench.pd import tls_report

    res = {"both": _result("both", [4.2, 4.4], [0.3, 0.3]),
           "both, mTLS off": _result("both, mTLS off", [4.0, 4.0], [0.3, 0.2]),
           "pd always": _result("pd always", [4.4], [0.3], push_ms=[110.0]),
           "pd always, mTLS off": _result("pd always, mTLS off", [4.0], [0.3], push_ms=[66.0])}
    text = tls_report(res)
    assert "| both | 4.30 / 4.00 | 1.08x (1.05–1.10) |" in text  # cold: medians, then the paired ratios
    assert "| pd always | 4.40 / 4.00 | 1.10x |" in text
    assert "| 0.60 / 1.00 | 0.60x |" in text  # hand-off GB/s (66 MB over the push time) and its ratio
    assert "mTLS off |" not in text  # a twin is no row of its own


def test_greedy_text_that_differs_with_mtls_off_shows_as_such():
    from app.bench.pd import tls_report

    text = tls_report({"both": _result("both", [4.0], [0.3]),
                       "both, mTLS off": _result("both, mTLS off", [4.0], [0.3], text="other")})
    assert text.splitlines()[2].endswith("| False |")
