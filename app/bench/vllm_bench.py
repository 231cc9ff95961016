"""``kvmesh bench vllm``: kvmesh instances that run vLLM, against vLLM alone and the routers put in front of it.

    kvmesh bench vllm --serving [...]   the mesh's cost over standalone `vllm serve` (app.bench.vllm_serving)
    kvmesh bench vllm --routing [...]   routing from vLLM's KV events vs vllm-router, sglang-router
                                        (app.bench.vllm_routing)
    kvmesh bench vllm --sessions [...]  a paused session's KV on a vLLM instance, with the session's signals
                                        and without (app.bench.vllm_sessions)

Both need vLLM (`make vllm`) and run with the Python it is installed in.
"""

from __future__ import annotations

import sys

MODES = {"--serving": "vllm_serving", "--routing": "vllm_routing", "--sessions": "vllm_sessions"}


def main(argv: list[str] | None = None) -> int:
    import importlib
    import importlib.util

    argv = list(sys.argv[1:] if argv is None else argv)
    modes = [a for a in argv if a in MODES]
    if len(modes) != 1:
        print(f"kvmesh bench vllm: give one of {' or '.join(MODES)} (then that bench's options; --help after it "
              "lists them)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None:
        print("kvmesh bench vllm: vLLM is not installed in this Python: `make vllm` installs it", file=sys.stderr)
        return 2
    module = importlib.import_module(f"app.bench.{MODES[modes[0]]}")
    return module.main([a for a in argv if a != modes[0]])


if __name__ == "__main__":
    raise SystemExit(main())
