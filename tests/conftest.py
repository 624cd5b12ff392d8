"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def dist():
    """A one-process torch.distributed world (gloo) for a module's tests, torn down after them."""
    from streamrft.runtime.distributed import destroy_distributed, init_distributed

    info = init_distributed(timeout_s=60)
    yield info
    destroy_distributed()



# `make test` runs two groups (see the Makefile): "workers" in two pytest-xdist workers, a file each, and
# "serial" in one process. Every test outside tests/integration is in "workers", and so is an integration
# module marked `in_process`; the other integration tests start ranks, engines or services whose timeouts
# fired when two of them shared CI's two cores, so they run one at a time.
GROUPS = ("workers", "serial")
INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_addoption(parser):
    parser.addoption("--test-group", choices=GROUPS, default=None,
                     help="run only make test's 'workers' group (tests outside tests/integration and integration "
                          "modules marked in_process) or its 'serial' group (the other integration tests)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "in_process: an integration test that runs in pytest's own process on one thread (no ranks, "
        "engine or service processes), so `make test` runs it in its two-worker group")


def group_of(item) -> str:
    if INTEGRATION in item.path.parents and item.get_closest_marker("in_process") is None:
        return "serial"
    return "workers"


def pytest_collection_modifyitems(config, items):
    group = config.getoption("--test-group")
    if group is None:
        return
    keep = [item for item in items if group_of(item) == group]
    dropped = [item for item in items if group_of(item) != group]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
