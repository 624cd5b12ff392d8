"""``streamrft trajectories {analyze,render} ...``: the subcommand the main CLI delegates to."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from streamrft.sinks.analyze import analyze_main
from streamrft.sinks.render import render_main

_COMMANDS = {"analyze": analyze_main, "render": render_main}


def trajectories_main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in _COMMANDS:
        print("usage: streamrft trajectories {analyze,render} PATH [options]  (--help after a command)",
              file=sys.stderr)
        return 2
    return _COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(trajectories_main())
