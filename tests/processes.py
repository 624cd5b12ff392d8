"""The live processes of a test's run, found by what their command line holds (read from /proc): what a test
checks is gone after a stop, a kill or a timeout."""

from __future__ import annotations

import os


def live_processes(*markers: str) -> list[int]:
    """Pids of the processes, zombies excluded, whose command line holds every one of ``markers``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # it ended while we looked
            continue
        if all(marker in cmd for marker in markers) and state != "Z":
            pids.append(int(entry))
    return pids
