"""Each engine entry point serves one role; asked for another, it says which entry point serves that one (role
``both`` is composed in the application layer, ``app/both.py``, since a service never imports another)."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(("module", "role", "points_at"), [
    ("services.prefill", "both", "python -m app.both"), ("services.prefill", "decode", "python -m services.decode"),
    ("services.decode", "both", "python -m app.both"), ("services.decode", "prefill", "python -m services.prefill"),
    ("app.both", "decode", "python -m services.decode"),
])
def test_an_engine_entry_point_asked_for_another_role_says_where_it_is_served(
        module: str, role: str, points_at: str, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(f"{module}.__main__" if module.startswith("services.") else module).main
    with pytest.raises(SystemExit) as exit_info:
        main(["--role", role])
    assert exit_info.value.code == 2
    assert points_at in capsys.readouterr().err
