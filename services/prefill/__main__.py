"""`python -m services.prefill`: an engine instance serving the Prefill RPC (role `prefill`)."""

from kvmesh.instance import cli

from services.prefill.servicer import ROLE


def main(argv: list[str] | None = None) -> None:
    cli.main("prefill", [ROLE], argv)


if __name__ == "__main__":
    main()
