"""`python -m services.decode`: run an engine instance with role `decode` (or `--role both`)."""

from kvmesh.worker.main import main

if __name__ == "__main__":
    main("decode")
