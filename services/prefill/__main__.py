"""`python -m services.prefill`: run an engine instance with role `prefill` (or `--role both`)."""

from kvmesh.worker.main import main

if __name__ == "__main__":
    main("prefill")
