"""``python -m benchmarks``: see ``benchmarks/README.md`` and ``--help``."""

from .cli import main

raise SystemExit(main())
