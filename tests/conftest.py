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


# `make test` runs two groups (see the Makefile). "unit": every test outside tests/integration, and an
# integration test marked `one_process`; "integration": the other integration tests, which start ranks,
# engines or services whose timeouts fired when two of them shared CI's two cores, so they run one at a time.
GROUPS = ("unit", "integration")
INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_addoption(parser):
    parser.addoption("--test-group", choices=GROUPS, default=None,
                     help="run only make test's 'unit' group (tests outside tests/integration and integration tests "
                          "marked one_process) or its 'integration' group (the other integration tests)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "one_process: an integration test that keeps one process busy at a time on one thread (pytest's "
        "own, or one subprocess pytest waits on; no ranks, engine or service beside it), so `make test` runs it in "
        "its unit group")


def group_of(item) -> str:
    if INTEGRATION in item.path.parents and item.get_closest_marker("one_process") is None:
        return "integration"
    return "unit"


def pytest_collection_modifyitems(config, items):
    group = config.getoption("--test-group")
    if group is None:
        return
    keep = [item for item in items if group_of(item) == group]
    dropped = [item for item in items if group_of(item) != group]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
