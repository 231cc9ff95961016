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
