"""Where a running stack keeps everything it writes, and how other commands find it.

Rule: ``--state-dir``, else ``$KVMESH_STATE_DIR``, else ``.kvmesh/`` in the working directory. ``kvmesh up`` writes
``stack.json`` there (endpoints of the running stack); ``kvmesh chat`` and ``kvmesh trace`` read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path


def state_dir(explicit: str | os.PathLike | None = None) -> Path:
    if explicit:
        return Path(explicit)
    from kvmesh.settings import SharedSettings  # the variable's one home: [shared] state_dir

    env = os.environ.get(SharedSettings.env_name("state_dir"))
    return Path(env) if env else Path.cwd() / ".kvmesh"


@dataclass
class StackInfo:
    router_grpc: str                  # host:port of the client gRPC API (the first router's, with replicas)
    router_http: str                  # http://host:port of the OpenAI-compatible API (likewise)
    nats_url: str
    cluster: str
    pids: dict[str, int] = field(default_factory=dict)
    endpoints: dict[str, dict[str, str]] = field(default_factory=dict)  # per service: what it bound (ready file)

    @property
    def router_grpcs(self) -> list[str]:
        """Every router replica's gRPC address (``router``, or ``router-0``, ``router-1``, ...), in order."""
        found = [e["grpc"] for name, e in sorted(self.endpoints.items(), key=lambda kv: _router_order(kv[0]))
                 if _router_order(name) >= 0 and "grpc" in e]
        return found or [self.router_grpc]

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "stack.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, directory: Path) -> StackInfo:
        path = directory / "stack.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"no running stack found: {path} does not exist (start one with `kvmesh up`, "
                                    "or pass --state-dir / set KVMESH_STATE_DIR)") from None


def _router_order(service: str) -> int:
    """``router`` 0, ``router-N`` N, any other service -1."""
    if service == "router":
        return 0
    head, _, n = service.partition("-")
    return int(n) if head == "router" and n.isdigit() else -1
