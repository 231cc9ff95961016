"""The mesh-across-hosts stage: tests marked ``netns`` run the services in network namespaces (a "host" each),
so they run only when asked for with ``-m netns`` (``make test-netns``); the main suite reports them as skipped.
Where the machine does not allow namespaces they skip and say why."""

import pytest

from app.netlab.hosts import unavailable

REASON = "the netns stage: run it with `make test-netns` (pytest -m netns tests/netns)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    asked = "netns" in (config.option.markexpr or "")
    why = unavailable() if asked else None
    for item in items:
        if item.get_closest_marker("netns"):
            if not asked:
                item.add_marker(pytest.mark.skip(reason=REASON))
            elif why:
                item.add_marker(pytest.mark.skip(reason=f"network namespaces are not allowed here: {why}"))
