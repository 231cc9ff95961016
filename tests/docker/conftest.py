"""The containers stage: tests marked ``docker`` build images and run the compose stack (minutes), so they run
only when asked for with ``-m docker`` (``make compose-test``); the main suite reports them as skipped."""

import pytest

REASON = "the containers stage: run it with `make compose-test` (pytest -m docker tests/docker)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "docker" in (config.option.markexpr or ""):
        return
    for item in items:
        if item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.skip(reason=REASON))
