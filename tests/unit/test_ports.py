"""tests/ports.py: the ports the integration tests hand to their child processes."""

import socket

import pytest

from tests import ports


def test_ports_lie_below_the_ephemeral_range_are_free_and_never_handed_out_twice():
    low, high = ports.ephemeral_range()
    drawn = [ports.free_port() for _ in range(50)]
    assert len(set(drawn)) == 50
    assert all(ports.LOWEST <= p < low or high < p for p in drawn)
    for p in drawn:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out, and nothing here took it since


def _listening_pair() -> tuple[socket.socket, int]:
    """A socket listening on a port of the candidate range whose next port is free."""
    for port in ports.candidate_ports()[::97]:
        held = socket.socket()
        try:
            held.bind(("127.0.0.1", port))
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
        except OSError:
            held.close()
            continue
        held.listen()
        return held, port
    raise AssertionError("no two adjacent free ports")


def test_a_port_in_use_is_skipped_and_none_free_is_an_error(monkeypatch):
    held, port = _listening_pair()
    with held:
        monkeypatch.setattr(ports, "_handed_out", set())
        monkeypatch.setattr(ports, "candidate_ports", lambda: [port, port + 1])
        assert ports.free_port() == port + 1
        with pytest.raises(RuntimeError, match=f"no free TCP port in {port}-{port + 1} after 200 draws"):
            ports.free_port()  # port + 1 was handed out, port is in use
