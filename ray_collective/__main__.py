"""``python -m ray_collective COMMAND``: the library's commands; one so far, ``status`` (see
``status``)."""

import sys
from typing import Optional, Sequence

from .status import main as status

USAGE = "usage: python -m ray_collective status [GROUP] [--address ADDRESS] [--json]"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command named first in ``argv`` (default: the process's arguments).

    Returns:
        The command's exit status; 2 for a command that does not exist.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] != "status":
        print(USAGE, file=sys.stderr)
        return 2
    return status(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
