"""The router's error kinds: one enum, each kind with its HTTP status and gRPC code, whose table the README lists
(generated, not copied). That no router module imports back into another is tests/unit/test_engine_seam.py's
check over the whole tree. And the ids intake gives requests that bring none: random, never repeated."""

from __future__ import annotations

from pathlib import Path

import grpc

from services.router.errors import STATUS, ErrorKind, RequestError, table
from services.router.ids import RandomHex, nonce

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "services" / "router" / "README.md"


def test_every_error_kind_has_an_http_status_a_grpc_code_and_a_type():
    assert set(STATUS) == set(ErrorKind)
    for kind in ErrorKind:
        assert 400 <= kind.http < 600 and isinstance(kind.grpc, grpc.StatusCode) and kind.error_type
    assert RequestError(ErrorKind.TOO_LARGE, "x").kind.http == 413


def test_the_readme_lists_the_error_kinds_of_the_enum():
    """The table between the markers is ``python -m services.router.errors``'s output."""
    text = README.read_text()
    listed = text.split("<!-- error kinds: python -m services.router.errors -->\n", 1)[1].split("<!-- end -->", 1)[0]
    assert listed == table(), "regenerate the table: python -m services.router.errors"


def test_the_readmes_error_examples_name_only_kinds_of_the_enum():
    examples = README.read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    named = {cell.strip("` ") for line in examples.splitlines() if line.startswith("| `")
             for cell in [line.split("|")[1]]}
    assert named and named <= {str(k) for k in ErrorKind}, named - {str(k) for k in ErrorKind}


def test_request_ids_are_random_128_bit_hex_and_never_repeat_across_batches() -> None:
    ids = RandomHex()
    got = [ids(32 if n % 3 else 16) for n in range(3 * RandomHex.BATCH // 8 + 7)]  # across refills, two sizes
    assert len(set(got)) == len(got)
    assert all(len(i) in (16, 32) and int(i, 16) >= 0 for i in got)
    assert len({i[0] for i in got}) > 8  # no fixed digit, as a uuid4's version nibble would be
    assert len(nonce()) == 16 and nonce() != nonce()


def test_the_tokenize_threads_default_to_the_cores_the_router_may_run_on():
    import os
    import subprocess
    import sys

    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from services.router.core import usable_cores; print(usable_cores())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "1"
    from services.router.core import usable_cores
    assert usable_cores() == len(os.sched_getaffinity(0))
