"""Split pyproject.toml's runtime dependencies (plus the chosen extras) into torch.txt and requirements.txt,
so the image's dependency layers change only when those lists do, not on any edit of pyproject.toml.

    python3 docker/requirements.py pyproject.toml "cuda,mooncake" OUT_DIR
"""

import sys
import tomllib
from pathlib import Path


def main(pyproject: str, extras: str, out: str) -> None:
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    optional = project.get("optional-dependencies", {})
    chosen = [e for e in extras.replace(",", " ").split() if e]
    unknown = [e for e in chosen if e not in optional]
    if unknown:
        sys.exit(f"EXTRAS: unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    deps = project["dependencies"] + [d for e in chosen for d in optional[e]]
    is_torch = [d.split(";")[0].replace(" ", "").startswith(("torch=", "torch>", "torch<", "torch~")) or
                d.strip() == "torch" for d in deps]
    Path(out, "torch.txt").write_text("".join(d + "\n" for d, t in zip(deps, is_torch) if t))
    Path(out, "requirements.txt").write_text("".join(d + "\n" for d, t in zip(deps, is_torch) if not t))


if __name__ == "__main__":
    main(*sys.argv[1:])
