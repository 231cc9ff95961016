"""`python -m services.decode`: an engine instance serving the Decode RPC (role `decode`)."""

from kvmesh.instance import cli

from services.decode.servicer import ROLE


def main(argv: list[str] | None = None) -> None:
    cli.main("decode", [ROLE], argv)


if __name__ == "__main__":
    main()
