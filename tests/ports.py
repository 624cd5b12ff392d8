"""A TCP port for a test to hand to a process that binds it later (a torchrun rank's store, a service's
listener), or to dial where nothing listens.

Binding port 0 and closing it returns a port from the kernel's ephemeral range, the range every outgoing
connection takes its local port from too. Between the close and the child's bind, any connection on the machine
(the unit group's gloo and ZeroMQ sockets run beside the integration group in `make test`) may take that port, and
the child then fails with "address already in use", one run in many. The ports handed out here lie below that
range, where the kernel gives out none on its own, are checked free by a bind, and are not handed out twice by a
process.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10000  # above the well-known and registered ports services commonly take (9090, 9100, ...)
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range
_handed_out: set[int] = set()
_draw = random.Random()  # seeded from the OS, so a test's random.seed() does not make two processes agree


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where /proc does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def candidate_ports() -> range:
    """The ports ``free_port`` draws from: below the ephemeral range, or above it where it starts too low."""
    low, high = ephemeral_range()
    return range(LOWEST, low) if low - LOWEST >= 1000 else range(high + 1, 65536)


def free_port(attempts: int = 200) -> int:
    """A port outside the ephemeral range that nothing listens on now and this process has not handed out."""
    candidates = candidate_ports()
    for _ in range(attempts):
        port = _draw.choice(candidates)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {min(candidates)}-{max(candidates)} after {attempts} draws")
