"""``python -m app``: the ``kvmesh`` command line (app/cli.py)."""

import sys

from app.cli import main

sys.exit(main())
