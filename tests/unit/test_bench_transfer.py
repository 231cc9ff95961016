"""The transfer bench's TLS table: each backend under mutual TLS (sealed, and as a version-2 receiver takes it)
against itself in plain text, GB/s and CPU."""

from app.bench.transfer import MTLS, V2, _plain, tls_table


def test_the_tls_table_shows_each_tls_backend_against_its_plain_twin_per_size():
    rows = [{"backend": "tcp", "size": 1 << 20, "gbps": 1.0, "cpu_per_gb": 0.5},
            {"backend": "tcp", "size": 16 << 20, "gbps": 1.0, "cpu_per_gb": 0.4},
            {"backend": "tcp" + MTLS, "size": 1 << 20, "gbps": 0.8, "vs_plain": 0.8, "cpu_per_gb": 1.0},
            {"backend": "tcp" + MTLS, "size": 16 << 20, "gbps": 0.9, "vs_plain": 0.9, "cpu_per_gb": 1.2}]
    text = tls_table(rows)
    assert "| tcp + mTLS vs tcp | 0.80x (CPU 1.00 / 0.50 s/GB) | 0.90x (CPU 1.20 / 0.40 s/GB) |" in text
    assert "| tcp |" not in text


def test_the_version_2_row_is_compared_with_the_same_plain_backend():
    rows = [{"backend": "tcp", "size": 1 << 20, "gbps": 1.0, "cpu_per_gb": 0.5},
            {"backend": "tcp" + V2, "size": 1 << 20, "gbps": 0.6, "vs_plain": 0.6, "cpu_per_gb": 1.5}]
    assert _plain("tcp" + V2) == _plain("tcp" + MTLS) == "tcp"
    assert "| tcp + mTLS (v2) vs tcp | 0.60x (CPU 1.50 / 0.50 s/GB) |" in tls_table(rows)
