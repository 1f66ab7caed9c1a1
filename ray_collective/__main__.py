"""``python -m ray_collective COMMAND``: the library's commands; one so far, ``status`` (see
``backends.ray.status``). ``--help`` lists every command and its options."""

import argparse
import sys
from typing import Optional, Sequence

from .backends.ray import status


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m ray_collective``: one sub-command per command."""
    top = argparse.ArgumentParser(
        prog="python -m ray_collective",
        description="ray_collective's commands. Each reads the cluster the way `ray status` "
                    "does (--address, else RAY_ADDRESS, else the one cluster on this machine).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    status_parser = status.add_arguments(commands.add_parser(
        "status", help=status.DESCRIPTION, description=status.DESCRIPTION))
    top.epilog = status_parser.format_help()
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command named first in ``argv`` (default: the process's arguments).

    Returns:
        The command's exit status; 0 for ``--help``; 2 for a command or option that does not
        exist (argparse's message on stderr).
    """
    try:
        args = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as stop:
        return int(stop.code or 0)
    return status.run(args)


if __name__ == "__main__":
    sys.exit(main())
