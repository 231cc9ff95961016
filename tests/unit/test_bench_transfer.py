"""The transfer bench's TLS table: each backend under mutual TLS against itself in plain text."""

from app.bench.transfer import MTLS, tls_table


def test_the_tls_table_shows_each_tls_backend_against_its_plain_twin_per_size():
    rows = [{"backend": "tcp", "size": 1 << 20, "gbps": 1.0},
            {"backend": "tcp" + MTLS, "size": 1 << 20, "gbps": 0.8, "vs_plain": 0.8},
            {"backend": "tcp" + MTLS, "size": 16 << 20, "gbps": 0.9, "vs_plain": 0.9}]
    text = tls_table(rows)
    assert "| tcp + mTLS vs tcp | 0.80x | 0.90x |" in text
    assert "| tcp |" not in text
