"""A throwaway CA and a certificate for 127.0.0.1/localhost, made with the openssl command line (tests only)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def make_certs(d: Path) -> dict[str, str]:
    """``ca``, ``cert``, ``key`` (server and client use the same mesh certificate) and ``other_ca`` (a stranger)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed; it makes the test certificates")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    for ca in ("ca", "other_ca"):
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
            "-days", "2", "-subj", f"/CN=kvmesh test {ca}")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "mesh.key", "-out", "mesh.csr", "-subj", "/CN=kvmesh")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "mesh.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "mesh.pem", "-days", "2", "-extfile", "san.ext")
    return {"ca": str(d / "ca.pem"), "cert": str(d / "mesh.pem"), "key": str(d / "mesh.key"),
            "other_ca": str(d / "other_ca.pem")}


def tls_env(certs: dict[str, str]) -> dict[str, str]:
    return {"KVMESH_TLS_CERT": certs["cert"], "KVMESH_TLS_KEY": certs["key"], "KVMESH_TLS_CA": certs["ca"]}
