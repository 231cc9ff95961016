"""Split pyproject.toml's runtime dependencies (plus the chosen extras) into the lists the image's dependency
layers install, so those layers change only when the lists do, not on any edit of pyproject.toml:

- ``torch.txt``: torch alone (it comes from its own index or a local wheel);
- ``requirements.txt``: everything else, for the engine images (prefill, decode);
- ``light.txt``: what the router, cachesvc and nats images need: ``requirements.txt`` without the
  ``[tool.kvmesh.images] engine-only`` packages.

    python3 docker/requirements.py pyproject.toml "cuda,mooncake" OUT_DIR
"""

import re
import sys
import tomllib
from pathlib import Path


def name(requirement: str) -> str:
    """The distribution name of a requirement line, normalised (PEP 503): ``Torch>=2; ...`` -> ``torch``."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        sys.exit(f"cannot read the requirement {requirement!r} in pyproject.toml")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def main(pyproject: str, extras: str, out: str) -> None:
    meta = tomllib.loads(Path(pyproject).read_text())
    project = meta["project"]
    optional = project.get("optional-dependencies", {})
    chosen = [e for e in extras.replace(",", " ").split() if e]
    unknown = [e for e in chosen if e not in optional]
    if unknown:
        sys.exit(f"EXTRAS: unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    engine_only = {name(n) for n in meta["tool"]["kvmesh"]["images"]["engine-only"]}
    deps = project["dependencies"] + [d for e in chosen for d in optional[e]]
    rest = [d for d in deps if name(d) != "torch"]
    Path(out, "torch.txt").write_text("".join(d + "\n" for d in deps if name(d) == "torch"))
    Path(out, "requirements.txt").write_text("".join(d + "\n" for d in rest))
    Path(out, "light.txt").write_text("".join(d + "\n" for d in rest if name(d) not in engine_only))


if __name__ == "__main__":
    main(*sys.argv[1:])
