"""``streamrft trajectories {analyze,render} ...``: the subcommand the main CLI delegates to."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from streamrft.sinks.analyze import analyze_main
from streamrft.sinks.render import render_main

_COMMANDS = {"analyze": analyze_main, "render": render_main}


def trajectories_main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: streamrft trajectories {analyze,render} PATH [options]  (--help after a command)"
    if args[:1] in (["-h"], ["--help"]):  # asked for: stdout and exit 0, as argparse does
        print(f"{usage}\n\n  analyze  what the policy writes: repetition, lengths, entropy (trajectory files)\n"
              "  render   an HTML page of trajectories")
        return 0
    if not args or args[0] not in _COMMANDS:
        print(usage, file=sys.stderr)
        return 2
    return _COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(trajectories_main())
