"""``python -m kvmesh.settings reference``: the settings reference (docs/configuration.md);
``python -m kvmesh.settings show``: the effective settings of this environment as JSON."""

from __future__ import annotations

import json
import sys

from kvmesh.settings import reference, show


def main(argv: list[str]) -> int:
    if argv[:1] == ["reference"]:
        print(reference(), end="")
        return 0
    if argv[:1] == ["show"]:
        try:
            print(json.dumps(show(argv[1] if len(argv) > 1 else None), indent=2))
        except (OSError, ValueError) as e:
            print(f"kvmesh settings: {e}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m kvmesh.settings reference | show [FILE.toml]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
