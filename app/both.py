"""`python -m app.both`: one engine instance serving Prefill and Decode (role `both`, `kvmesh up --both N`).

Composed here, in the application layer, because it is the one layer that may know several services: each
service hands the engine host its role, and this process hands it both. ``Decode(prefill_locally=true)``
then computes the prompt itself (disaggregation off); a Prefill call may push to this same instance."""

from kvmesh.instance import cli

from services.decode.servicer import ROLE as DECODE
from services.prefill.servicer import ROLE as PREFILL


def main(argv: list[str] | None = None) -> None:
    cli.main("both", [PREFILL, DECODE], argv)


if __name__ == "__main__":
    main()
